"""router.transport.worker_http against raw loopback servers: every way a worker call can fail maps to the
failure the orchestrator acts on (router.transport.upstream.classify), and keep-alive reuse works."""
from __future__ import annotations

import asyncio

import pytest

from router.transport.upstream import classify
from router.transport.worker_http import (
    ConnectFailed,
    Disconnected,
    Origin,
    ProtocolError,
    ReadTimeout,
    UnsendableRequest,
    WorkerClient,
)
from shared.net import free_port as _free_port

OK_BODY = b'{"ok": true}'


def _ok(body: bytes = OK_BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


class RawServer:
    """A loopback server whose per-connection behaviour is a coroutine; counts connections."""

    def __init__(self, behaviour) -> None:
        self.behaviour, self.connections, self.requests = behaviour, 0, []

    async def __aenter__(self) -> RawServer:
        async def handle(reader, writer):
            self.connections += 1
            try:
                await self.behaviour(self, reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()
        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def _post(client: WorkerClient, url: str, body: bytes = b"{}", read_timeout: float = 2.0, headers=None):
    return await client.post(client.origin(url), "/v1/chat/completions", body, headers or {"x-request-id": "r1"},
                             connect_timeout=1.0, read_timeout=read_timeout)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_answer_and_keep_alive_reuse():
    async def serve(server, reader, writer):
        while True:
            server.requests.append(await _read_request(reader))
            writer.write(_ok())
            await writer.drain()

    async def main():
        async with RawServer(serve) as server:
            client = WorkerClient()
            for _ in range(3):
                resp = await _post(client, server.url, b'{"a": 1}')
                assert resp.status == 200 and resp.headers["content-type"] == "application/json"
                assert await resp.read() == OK_BODY
                resp.release()
            assert server.connections == 1                     # one pooled connection served all three
            first = server.requests[0]
            assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"x-request-id: r1\r\n" in first and first.endswith(b'\r\n\r\n{"a": 1}')
            await client.close()
    run(main())


def test_connection_close_answers_are_not_reused_and_closed_responses_drop_the_connection():
    async def serve(server, reader, writer):
        while True:
            await _read_request(reader)
            writer.write(_ok(extra=b"connection: close\r\n") if server.connections == 1 else _ok())
            await writer.drain()

    async def main():
        async with RawServer(serve) as server:
            client = WorkerClient()
            for _ in range(2):
                resp = await _post(client, server.url)
                await resp.read()
                resp.release()
            assert server.connections == 2                     # the first said "connection: close"
            resp = await _post(client, server.url)
            resp.close()                                       # body unread: the connection is dropped
            resp = await _post(client, server.url)
            assert await resp.read() == OK_BODY
            assert server.connections == 3
            await client.close()
    run(main())


def test_refused_connection_is_a_connect_failure_retried_elsewhere():
    async def main():
        client = WorkerClient()
        with pytest.raises(ConnectFailed) as info:
            await _post(client, f"http://127.0.0.1:{_free_port()}")
        err = classify(info.value, "decode")
        assert (err.reason, err.status, err.retryable, err.health_outcome) == ("connect", 503, True, False)
    run(main())


def test_close_before_any_answer_is_disconnected_and_replayable_only_when_safe():
    async def serve(server, reader, writer):
        await _read_request(reader)                            # read it, answer nothing, close

    async def main():
        async with RawServer(serve) as server:
            with pytest.raises(Disconnected) as info:
                await _post(WorkerClient(), server.url)
        safe = classify(info.value, "prefill", replay_safe=True)
        assert (safe.reason, safe.status, safe.retryable) == ("disconnected", 502, True)
        unsafe = classify(info.value, "decode", replay_safe=False)
        assert (unsafe.reason, unsafe.status, unsafe.retryable,
                unsafe.health_outcome) == ("transport", 502, False, False)
    run(main())


def test_silence_before_the_headers_and_mid_body_is_a_read_timeout():
    async def silent(server, reader, writer):
        await _read_request(reader)
        await asyncio.sleep(10)

    async def stalls_mid_body(server, reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
        await writer.drain()
        await asyncio.sleep(10)

    async def main():
        async with RawServer(silent) as server:
            with pytest.raises(ReadTimeout) as info:
                await _post(WorkerClient(), server.url, read_timeout=0.3)
            err = classify(info.value, "decode")
            assert (err.reason, err.status, err.retryable, err.health_outcome) == ("timeout", 504, False, False)
        async with RawServer(stalls_mid_body) as server:
            resp = await _post(WorkerClient(), server.url, read_timeout=0.3)
            assert resp.status == 200
            with pytest.raises(ReadTimeout):
                await resp.read()
            resp.close()
    run(main())


def test_a_worker_error_status_is_an_answer_not_a_transport_failure():
    async def serve(server, reader, writer):
        await _read_request(reader)
        body = b'{"error": {"message": "busy", "type": "server_error"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        async with RawServer(serve) as server:
            resp = await _post(WorkerClient(), server.url)
            assert resp.status == 503 and b"busy" in await resp.read()
            resp.release()
    run(main())


def test_malformed_and_cut_off_answers_are_protocol_errors():
    async def garbage(server, reader, writer):
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def cut(server, reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()                                   # then close: 91 bytes short

    async def main():
        async with RawServer(garbage) as server:
            with pytest.raises(ProtocolError) as info:
                await _post(WorkerClient(), server.url)
            assert classify(info.value, "decode").reason == "transport"
        async with RawServer(cut) as server:
            resp = await _post(WorkerClient(), server.url)
            with pytest.raises(ProtocolError):
                await resp.read()
            resp.close()
    run(main())


def test_a_request_that_cannot_be_built_is_the_routers_fault():
    async def main():
        client = WorkerClient()
        with pytest.raises(UnsendableRequest) as info:
            await _post(client, "http://127.0.0.1:1", headers={"x-request-id": "a\r\nx-evil: 1"})
        err = classify(info.value, "decode")
        assert (err.status, err.health_outcome, err.retryable) == (500, None, False)
        with pytest.raises(UnsendableRequest):
            client.origin("ftp://example.com")
    run(main())


def test_chunked_stream_arrives_as_it_is_sent():
    async def serve(server, reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        async with RawServer(serve) as server:
            resp = await _post(WorkerClient(), server.url)
            chunks = [chunk async for chunk in resp.iter_any()]
            assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert len(chunks) == 3                            # relayed as they came, not at the end
            resp.release()
    run(main())


def test_origin_parsing():
    origin = Origin.parse("http://[::1]:8080/base/")
    assert (origin.host, origin.port, origin.base_path, origin.host_header) == ("::1", 8080, "/base", b"[::1]:8080")
    assert Origin.parse("https://w.example").port == 443


def test_a_stream_released_before_its_last_chunk_is_reused_once_it_ends():
    """The relay stops at [DONE]; the chunked body's end comes a moment later: the connection is
    parked then, not dropped (a stream per new connection costs a connect and a close)."""
    async def serve(server, reader, writer):
        while True:
            await _read_request(reader)
            event = b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main():
        async with RawServer(serve) as server:
            client = WorkerClient()
            for _ in range(2):
                resp = await _post(client, server.url)
                async for chunk in resp.iter_any():
                    assert chunk.endswith(b"[DONE]\n\n")
                    break                                      # as the relay does
                resp.release()
                await asyncio.sleep(0.3)
            assert server.connections == 1
            await client.close()
    run(main())
