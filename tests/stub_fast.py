"""The stub worker's handlers (tests.stub_worker.Stub) behind a bare asyncio + httptools HTTP/1.1
server, for router benchmarks that need a worker faster than the router in front of it.

Why: the FastAPI stub serves ~2,000 requests/s on one core here, below what the routers under test
forward, so a throughput run would measure the stub. This server answers the same routes with the
same bodies, leg rules and `/stats` counters (it calls the same `Stub` methods), without the ASGI
layers: one parser per connection, one `transport.write` per answer (a stream: one per chunk, in
chunked encoding). Keep-alive only; no pipelining guarantees beyond answering in order, no upgrades.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httptools

from tests.stub_worker import Leg, Stub, StubError, StubSettings, _dumps

_PHRASES = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


def _head(status: int, content_type: bytes, extra: dict[str, str], length: int | None) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _PHRASES.get(status, b"")), b"content-type: " + content_type]
    lines += [f"{k}: {v}".encode() for k, v in extra.items()]
    lines.append(b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _json(status: int, obj: Any, extra: dict[str, str] | None = None) -> bytes:
    body = _dumps(obj)
    return _head(status, b"application/json", extra or {}, len(body)) + body


class StubProtocol(asyncio.Protocol):
    """One connection: parse requests with httptools, answer each from the shared `Stub`."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.tail: asyncio.Future | None = None       # the previous streamed answer, so answers stay in order

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport                    # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_json(400, {"error": {"message": "malformed HTTP request"}}))
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, path = self.parser.get_method(), self.url.split(b"?", 1)[0]
        raw, self.url, self.body = b"".join(self.body), b"", []
        answer = self.answer(method, path, raw)
        if isinstance(answer, bytes):
            self._write(answer)
        else:
            self.tail = asyncio.ensure_future(self._stream(answer, self.tail))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def answer(self, method: bytes, path: bytes, raw: bytes) -> bytes | tuple[Leg, dict[str, str]]:
        """The whole answer, or (a streamed leg, its headers) for `_stream`."""
        stub = self.stub
        if method == b"GET":
            if path == b"/health":
                return _json(200, {"status": "ok", "role": stub.s.role, "worker_id": f"stub-{stub.engine_id[:8]}"})
            if path == b"/stats":
                return _json(200, {kind: stub.counts[kind] for kind in ("prefill", "decode", "local")})
            if path == b"/v1/models":
                card = {"id": stub.s.served_model_name, "object": "model", "created": 0, "owned_by": "kimi-pd-stub"}
                return _json(200, {"object": "list", "data": [card]})
        endpoint = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}.get(path)
        if endpoint is None or method != b"POST":
            return _json(404, {"detail": "Not Found"})
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise StubError(400, f"invalid JSON body: {exc}") from exc
            leg = stub.parse(body, endpoint)
        except StubError as exc:
            error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
            return _json(exc.status, {"error": error})
        stub.counts[leg.kind] += 1
        headers = {"x-request-id": leg.request_id}
        if leg.kind == "decode":
            headers["x-kv-pull-seconds"] = "0.000000"
        if leg.stream or stub.s.token_delay_s or stub.s.first_token_delay_s:
            return leg, headers
        return _json(200, stub.whole(leg), headers)

    async def _stream(self, answer: tuple[Leg, dict[str, str]], before: asyncio.Future | None) -> None:
        leg, headers = answer
        if before is not None:
            await before
        if not leg.stream:                             # a delayed whole answer
            async with self.stub._slot():
                await asyncio.sleep(self.stub.s.first_token_delay_s + self.stub.s.token_delay_s * leg.num_tokens)
            self._write(_json(200, self.stub.whole(leg), headers))
            return
        self._write(_head(200, b"text/event-stream", headers, None))
        async for chunk in self.stub.chunks(leg):
            self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self._write(b"0\r\n\r\n")


async def serve(settings: StubSettings) -> None:
    """Serve until cancelled."""
    stub = Stub(settings)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(stub), settings.host, settings.port, backlog=1024)
    async with server:
        await server.serve_forever()


def run(settings: StubSettings) -> None:
    try:
        import uvloop
        uvloop.run(serve(settings))
    except ImportError:
        asyncio.run(serve(settings))
