"""The least a Python HTTP proxy can cost: a reference target for benchmarks/router_overhead.py.

Run: `python -m benchmarks.python_floor --port P --upstream http://127.0.0.1:Q` (one process).

Why: issue 30 asks the router to match sglang-router's requests/s and added latency on the same 2-core
machine. This proxy does only what every Python proxy must: parse the client's HTTP/1.1 request
(httptools), send its bytes unchanged to one upstream over a pooled keep-alive connection, parse the
answer and write it back, on uvloop. No JSON, no validation, no routing, no metrics, no logs. What it
costs per request (CPU, added latency) is a floor for any router written in Python here: if the floor
is above a peer's figure, matching that peer takes another language for the data path, not tuning.
Not for serving: no streaming relay beyond whole bodies, no timeouts, no error mapping.
"""
from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit

import httptools


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to the upstream; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport                    # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        waiter, body, self.waiter, self.body = self.waiter, b"".join(self.body), None, []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("upstream closed the connection"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.idle = host, port, []  # type: tuple[str, int, list[UpstreamConnection]]

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self.idle:
            conn = self.idle.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(UpstreamConnection, self.host, self.port)
        answer = await conn.send(data)
        self.idle.append(conn)
        return answer


class FrontConnection(asyncio.Protocol):
    """One client connection: each complete request is forwarded as it came, the answer written back."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.parser = pool, httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body = b"", []  # type: bytes, list[bytes]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport                    # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, url, body, self.url, self.body = self.parser.get_method(), self.url, b"".join(self.body), b"", []
        head = b"%s %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        asyncio.ensure_future(self.relay(head % (method, url, len(body)) + body))

    async def relay(self, data: bytes) -> None:
        status, body = await self.pool.request(data)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % (status, len(body)) + body)


async def serve(port: int, upstream: str) -> None:
    parts = urlsplit(upstream)
    pool = Pool(parts.hostname or "127.0.0.1", parts.port or 80)
    server = await asyncio.get_running_loop().create_server(lambda: FrontConnection(pool), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.python_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="http://host:port of the one upstream")
    args = parser.parse_args()
    import uvloop
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
