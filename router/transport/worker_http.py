"""The router's HTTP/1.1 client for worker legs: pooled keep-alive connections on asyncio protocols,
responses parsed by httptools (the C parser uvicorn uses), bodies relayed as raw bytes.

Why not aiohttp or httpx: a worker leg is one POST of bytes the router already has and one reply it
relays, and the general clients spend more CPU per call on machinery it never uses (cookie jars,
multidicts, payload registries, per-call timeout contexts) than the router spends routing
(benchmarks/router_overhead.py). What this client does, it does the way they do: a per-origin pool
of idle connections (LIFO, dropped after `keepalive_s` idle, before a worker's own keep-alive timer
closes them), TCP_NODELAY on every socket, a connect bound and an idle-read bound.

Failures are typed so the caller can tell whether the worker ever saw the request
(`router.transport.upstream.classify` maps them):

- `ConnectFailed`: no connection (refused, unreachable, connect timeout): the request was never sent;
- `Disconnected`: the connection closed or reset before any byte of a response (a pooled connection
  the worker was closing as it was reused, or a worker that died on receipt);
- `ReadTimeout`: no bytes for longer than the read bound;
- `ProtocolError`: a malformed response, or one cut off mid-body;
- `UnsendableRequest`: the request could not be built (a bad URL or header): the router's own fault.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 3.0                  # idle pooled connections older than this are not reused (uvicorn: 5 s)
MAX_BUFFERED = 1 << 20             # body bytes held for a slow reader before reading from the worker pauses


class WorkerHTTPError(Exception):
    """A call to a worker failed in transport (never an HTTP status: those are answers)."""


class UnsendableRequest(WorkerHTTPError):
    """The request could not be built or sent (bad URL, illegal header): the router's fault."""


class ConnectFailed(WorkerHTTPError):
    """No connection could be made: the worker never saw the request."""


class Disconnected(WorkerHTTPError):
    """The connection closed before any response byte: nothing was answered."""


class ReadTimeout(WorkerHTTPError):
    """The worker sent nothing for longer than the read bound."""


class ProtocolError(WorkerHTTPError):
    """A malformed response, or a connection lost in the middle of one."""


@dataclass(frozen=True)
class Origin:
    """Where a worker is: parsed once per worker URL."""

    scheme: str
    host: str
    port: int
    base_path: str                 # the URL's path without a trailing slash ("" for a bare host)

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode("ascii")

    @classmethod
    def parse(cls, url: str) -> Origin:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise UnsendableRequest(f"bad worker URL {url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UnsendableRequest(f"bad worker URL {url!r}: give http[s]://host[:port]")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))


def _check_header(value: str) -> bytes:
    raw = value.encode("latin-1")
    if b"\r" in raw or b"\n" in raw or b"\0" in raw:
        raise UnsendableRequest("a header value holds a line break")
    return raw


class WorkerResponse:
    """One response: status and headers as soon as they are in; the body read whole (`read`) or
    chunk by chunk as it arrives (`iter_any`). End with `release` (a fully read body returns the
    connection to the pool) or `close` (drops it: the worker sees the disconnect)."""

    __slots__ = ("status", "headers", "_conn")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        self._conn: _Connection | None = conn

    async def read(self) -> bytes:
        conn, parts = self._conn, []
        assert conn is not None, "read after release or close"
        while (chunk := await conn.next_body()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        conn = self._conn
        assert conn is not None, "read after release or close"
        while True:
            chunk = await conn.next_body()
            if chunk is None:
                return
            yield chunk

    def release(self) -> None:
        """Done with the body: the connection is reused if the response is complete (a stream's
        relay may stop at its [DONE] event), else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reusable=True)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reusable=False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight (no pipelining)."""

    def __init__(self, pool: WorkerClient, origin: Origin) -> None:
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport               # set by connection_made, before any use
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.lost = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.waiter: asyncio.Future | None = None
        self.headers: dict[str, str] = {}
        self.headers_done = self.complete = self.got_bytes = self.keep_alive = False
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.error: WorkerHTTPError | None = None
        self.park_when_complete = False
        self.paused = False
        self.read_timeout = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.last_read = 0.0

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)        # a stream connection
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)      # no Nagle stall on small writes

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"malformed response: {exc}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._forget(self)
        if self.complete:
            return
        if not self.got_bytes:
            self._fail(Disconnected(f"the worker closed the connection{': ' + str(exc) if exc else ''}"))
        elif self.headers_done and "content-length" not in self.headers \
                and "chunked" not in self.headers.get("transfer-encoding", ""):
            self.on_message_complete()                      # a body delimited by the end of the connection
        else:
            self._fail(ProtocolError("the worker closed the connection mid-response"))

    def pause_writing(self) -> None:      # request bodies are bounded (max_request_bytes) and written at once
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks ----
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()    # llhttp forgets it once the message is complete
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.park_when_complete:
            return                                           # released: nobody reads the rest
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._stop_timer()
        if self.park_when_complete:
            self.park_when_complete = False
            self.finish(reusable=True)
            return
        self._wake()

    # ---- the request ----
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: WorkerHTTPError) -> None:
        if self.error is None:
            self.error = error
        self._stop_timer()
        self._wake()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        """Fires at most once per read bound; re-arms for the rest when bytes came meanwhile."""
        self.timer = None
        if self.complete or self.error is not None:
            return
        idle = self.loop.time() - self.last_read
        if idle < self.read_timeout:
            self.timer = self.loop.call_later(self.read_timeout - idle, self._on_timer)
            return
        self._fail(ReadTimeout(f"no bytes from the worker for {self.read_timeout:g} s"))
        self.transport.close()

    def send(self, head: bytes, body: bytes, read_timeout: float) -> None:
        self._reset()
        self.read_timeout = read_timeout
        self.last_read = self.loop.time()
        self.timer = self.loop.call_later(read_timeout, self._on_timer)
        if len(body) < 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def response_head(self) -> tuple[int, dict[str, str]]:
        while not self.headers_done and self.error is None:
            await self._wait()
        if self.error is not None and not self.headers_done:
            raise self.error
        return self.parser.get_status_code(), self.headers

    async def next_body(self) -> bytes | None:
        """The next body bytes, or None at the end of the body."""
        while True:
            if self.body:
                chunk = self.body.popleft() if len(self.body) == 1 else b"".join(self._drain())
                self.buffered = 0 if not self.body else self.buffered - len(chunk)
                if self.paused:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()

    def _drain(self):
        body = self.body
        while body:
            yield body.popleft()

    def finish(self, reusable: bool) -> None:
        if reusable and not self.complete and self.error is None and not self.lost:
            # a relay that stopped at [DONE]: the end of the chunked body is on its way; park the
            # connection when it comes (the read bound still closes it if it never does)
            self.park_when_complete = True
            self.body.clear()
            if self.paused:
                self.paused = False
                self.transport.resume_reading()
            return
        self._stop_timer()
        if reusable and self.complete and self.keep_alive and not self.lost:
            self.idle_since = self.loop.time()
            self.pool._park(self)
        else:
            self.transport.close()


class WorkerClient:
    """Pooled HTTP/1.1 client of the request path. One per router (created in the lifespan)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.parse(url)
        return origin

    async def post(self, origin: Origin, path: str, body: bytes, headers: Mapping[str, str], *,
                   connect_timeout: float, read_timeout: float) -> WorkerResponse:
        """POST `body` (JSON) to origin + path; returns once the response's headers are in. The
        caller must `release` or `close` the response."""
        head = self._head(origin, path, len(body), headers)
        conn = self._pooled(origin)
        if conn is None:
            conn = await self._connect(origin, connect_timeout)
        conn.send(head, body, read_timeout)
        try:
            status, reply_headers = await conn.response_head()
        except BaseException:
            conn.finish(reusable=False)
            raise
        return WorkerResponse(conn, status, reply_headers)

    @staticmethod
    def _head(origin: Origin, path: str, length: int, headers: Mapping[str, str]) -> bytes:
        lines = [b"POST ", (origin.base_path + path).encode("ascii"), b" HTTP/1.1\r\nhost: ", origin.host_header,
                 b"\r\ncontent-type: application/json\r\ncontent-length: ", str(length).encode("ascii"), b"\r\n"]
        for name, value in headers.items():
            lines += (_check_header(name), b": ", _check_header(value), b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _pooled(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = asyncio.get_running_loop().time() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.idle_since >= oldest_ok and not conn.transport.is_closing():
                return conn
            conn.transport.close()
        return None

    async def _connect(self, origin: Origin, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = None
        if origin.scheme == "https":
            ssl_context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, origin), origin.host, origin.port,
                                                       ssl=ssl_context)
        except TimeoutError:
            raise ConnectFailed(f"connecting to the worker took longer than {timeout:g} s") from None
        except (OSError, ssl.SSLError) as exc:          # refused, unreachable, DNS, TLS handshake
            raise ConnectFailed(f"could not connect to the worker: {exc}") from None
        self._open.add(conn)
        return conn

    def _park(self, conn: _Connection) -> None:
        self._idle.setdefault(conn.origin, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        await asyncio.sleep(0)
