"""The router's HTTP server protocol: uvicorn's httptools protocol (with the header deadline of
`shared.http_server`) that serves the two OpenAI POST routes itself, straight from the parser's
callbacks, and hands everything else to the ASGI app as uvicorn does.

Why: on the hot routes the ASGI layers (the per-request cycle and its message dicts, the proxy-header
middleware, Starlette's response `__call__`, a watcher task per request for a leaving client) cost
more CPU per request than the router's own work (benchmarks/router_overhead.py). Here a hot request:

- is bounded as it arrives: a declared or received body over `max_request_bytes` gets the app's own
  413 at once, before the rest is read (the connection stays usable: the rest is discarded);
- runs its handler (`FastPathApp.fast_routes`) in one task once the body is in; errors are rendered
  by the app's exception handlers, as on the routed path;
- is answered by writing status line, headers and body in one `transport.write`; a streamed
  response goes out in chunked encoding, one write per chunk, paced by the transport's flow control;
- is cancelled when the client goes away (the connection is lost): the handler's cleanup closes the
  upstream legs, and `shared.http.until_disconnect` needs no watcher task (`DISCONNECT_EXTENSION`).

Pipelined requests, upgrades and every other route take uvicorn's own path unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any, cast

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from router.transport.fast_path import FastPathApp
from shared.http import DISCONNECT_EXTENSION, BodyTooLarge
from shared.http_server import protocol_class

log = logging.getLogger(__name__)
_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        from http import HTTPStatus
        try:
            phrase = HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


class Exchange:
    """One hot request on a connection. Duck-types what uvicorn's protocol reads of its request
    cycle (`response_complete`, `disconnected`, `keep_alive`, `message_event`), so keep-alive,
    shutdown, the header deadline and connection loss work as for any request."""

    __slots__ = ("body", "size", "too_large", "response_complete", "disconnected", "keep_alive",
                 "message_event", "task", "expect_continue")

    def __init__(self, keep_alive: bool, expect_continue: bool) -> None:
        self.body: list[bytes] = []
        self.size = 0
        self.too_large = False
        self.response_complete = self.disconnected = False
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.message_event = asyncio.Event()       # set by uvicorn's connection_lost
        self.task: asyncio.Task | None = None

    async def receive(self) -> dict:
        """ASGI receive for the handler: the body is already read, so only a disconnect can come."""
        if not (self.disconnected or self.response_complete):
            await self.message_event.wait()
        return {"type": "http.disconnect"}


if TYPE_CHECKING:                               # at run time the protocol's class comes second in the MRO
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Protocol
else:
    _Protocol = object


class HotRoutes(_Protocol):
    """The hot routes' half of the router's protocol, mixed in before uvicorn's httptools protocol
    (`front_protocol_class`): parser callbacks that take the two OpenAI POST routes, and their serving."""

    front_app: FastPathApp                      # set on the class `front_protocol_class` makes
    max_body_bytes: int

    hot: Exchange | None = None

    # ---- parser callbacks ----
    def on_headers_complete(self) -> None:
        handler = None
        if (self.parser.get_method() == b"POST" and (self.cycle is None or self.cycle.response_complete)
                and not self.parser.should_upgrade()):
            handler = self.front_app.fast_routes.get(self.url.partition(b"?")[0].decode("latin-1"))
        if handler is None:
            self.hot = None
            super().on_headers_complete()
            return
        http_version = self.parser.get_http_version()
        scope = cast(dict, self.scope)           # ASGI's TypedDict, filled in here as uvicorn does
        path, _, query = self.url.partition(b"?")
        scope.update(method="POST", path=path.decode("latin-1"), raw_path=path, query_string=query, app=self.front_app)
        if http_version != "1.1":
            scope["http_version"] = http_version
        exchange = Exchange(http_version != "1.0" and self.parser.should_keep_alive(), self.expect_100_continue)
        scope["extensions"] = {DISCONNECT_EXTENSION: exchange}
        self.hot, self.cycle = exchange, cast(Any, exchange)      # the exchange duck-types uvicorn's cycle
        self._handler = handler
        declared = next((v for k, v in self.headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            self._refuse_body(exchange)
        elif exchange.expect_continue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        exchange = self.hot
        if exchange is None or exchange is not self.cycle:
            super().on_body(body)
            return
        if exchange.too_large:
            return                                 # refused: the rest is read and dropped
        exchange.size += len(body)
        if exchange.size > self.max_body_bytes:
            exchange.body.clear()
            self._refuse_body(exchange)
            return
        exchange.body.append(body)

    def on_message_complete(self) -> None:
        exchange = self.hot
        if exchange is None or exchange is not self.cycle:
            super().on_message_complete()
            return
        self.hot = None
        if exchange.too_large:
            return
        body = exchange.body[0] if len(exchange.body) == 1 else b"".join(exchange.body)
        exchange.body = []
        self._start(exchange, self._serve(exchange, self._handler, cast(dict, self.scope), body))

    def connection_lost(self, exc: Exception | None) -> None:
        exchange = self.hot if self.hot is not None else self.cycle
        if isinstance(exchange, Exchange) and not exchange.response_complete:
            exchange.disconnected = True
            exchange.message_event.set()
            if exchange.task is not None:
                exchange.task.cancel()             # the handler's cleanup closes the upstream legs
        super().connection_lost(exc)

    # ---- serving ----
    def _start(self, exchange: Exchange, coro) -> None:
        task = exchange.task = self.loop.create_task(coro)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _refuse_body(self, exchange: Exchange) -> None:
        exchange.too_large = True
        self._start(exchange, self._serve_error(exchange, cast(dict, self.scope), BodyTooLarge(
            f"the request body is larger than {self.max_body_bytes} bytes")))

    async def _serve_error(self, exchange: Exchange, scope: dict, exc: Exception) -> None:
        request = Request(scope, exchange.receive)
        await self._answer(exchange, await self.front_app._render(request, exc))

    async def _serve(self, exchange: Exchange, handler, scope: dict, body: bytes) -> None:
        request = Request(scope, exchange.receive)
        request._body = body                       # Starlette's cache: request.stream() yields it
        try:
            try:
                response = await handler(request)
            except Exception as exc:               # noqa: BLE001 - rendered like the routed path does
                response = await self.front_app._render(request, exc)
            await self._answer(exchange, response)
        except asyncio.CancelledError:
            if not exchange.disconnected:
                raise
        except Exception:                          # noqa: BLE001 - a response that could not be sent
            log.exception("hot route %s failed", scope.get("path"))
            self._fail(exchange)

    async def _answer(self, exchange: Exchange, response: Response) -> None:
        if exchange.disconnected:
            await _close_body(response)
            return
        head: list[bytes | memoryview] = [_status_line(response.status_code)]
        for name, value in (*self.server_state.default_headers, *response.raw_headers):
            if _HEADER_VALUE.search(value):
                await _close_body(response)
                raise RuntimeError("Invalid HTTP header value.")
            head += (name, b": ", value, b"\r\n")
        if not exchange.keep_alive:
            head.append(b"connection: close\r\n")
        if isinstance(response, StreamingResponse):
            head.append(b"transfer-encoding: chunked\r\n\r\n")
            self.transport.write(b"".join(head))
            await self._stream(exchange, response)
        else:
            head += (b"\r\n", response.body)
            self.transport.write(b"".join(head))
        self._complete(exchange)
        if response.background is not None:
            await response.background()

    async def _stream(self, exchange: Exchange, response: StreamingResponse) -> None:
        body = response.body_iterator
        flow, transport = self.flow, self.transport
        try:
            async for chunk in body:
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    chunk = chunk.encode(response.charset)
                if not chunk:
                    continue
                if flow.write_paused:
                    await flow.drain()
                if exchange.disconnected:
                    return
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            transport.write(b"0\r\n\r\n")
        finally:
            await _close_body(response)           # a generator stopped at a yield runs its cleanup now

    def _complete(self, exchange: Exchange) -> None:
        exchange.response_complete = True
        exchange.message_event.set()
        if not exchange.keep_alive:
            self.transport.close()
        self.on_response_complete()               # keep-alive timer, header deadline, pipelined requests

    def _fail(self, exchange: Exchange) -> None:
        exchange.response_complete = True
        if not self.transport.is_closing():
            self.transport.close()


def front_protocol_class(header_timeout_s: float, app: FastPathApp, max_body_bytes: int) -> type:
    """The uvicorn `http=` protocol for the router (httptools only; with h11 the app's own fast path
    in `FastPathApp.__call__` still applies)."""
    base = protocol_class(header_timeout_s)
    if not hasattr(base, "on_url"):                # h11: no parser callbacks to hook
        return base
    return type(f"Router{base.__name__}", (HotRoutes, base), {"front_app": app, "max_body_bytes": max_body_bytes})


async def _close_body(response: Response) -> None:
    aclose = getattr(getattr(response, "body_iterator", None), "aclose", None)
    if aclose is not None:
        await aclose()
