"""The request path's ASGI shortcuts: POST /v1/chat/completions and /v1/completions go straight to
their handlers, past FastAPI's middleware, routing, dependency and exception layers; relayed
streams watch for a leaving client with one task.

Those handlers already own their validation and errors, and the layers they skip cost more CPU
per request than the router's own work (benchmarks/router_overhead.py, py-spy). Exceptions are
rendered by the app's own exception handlers (looked up along the exception's MRO, as Starlette
does), so a client sees exactly the responses the routed path gives. Everything else - other
paths and methods, lifespan, websockets - passes through to the app unchanged.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import cast

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class FastPathApp(FastAPI):
    """A FastAPI app whose hot POST routes (`fast_routes`) are called straight from `__call__`.

    uvicorn calls the app object itself, so this skips Starlette's middleware stack too (server
    error, FastAPI's telemetry and body-limit layers), not only its routing. Errors are rendered
    by the app's own exception handlers, looked up along the exception's MRO as Starlette does.
    """

    fast_routes: Mapping[str, Handler] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.fast_routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:                     # noqa: BLE001 - rendered like the routed path does
            response = await self._render(request, exc)
        await response(scope, receive, send)

    async def _render(self, request: Request, exc: Exception) -> Response:
        handlers = self.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return await cast(Awaitable[Response], handlers[cls](request, exc))     # ours are async
        raise exc


class EventStreamResponse(StreamingResponse):
    """A relayed SSE stream that notices a client leaving with one asyncio watcher task.

    uvicorn speaks ASGI 2.3, where a gone client shows only through `receive`; Starlette then runs
    every stream inside an anyio task group with a listener task, which costs more CPU per stream
    than the relay itself. Here the watcher cancels the sending task when `http.disconnect` comes
    (the body iterator's cleanup then closes the upstream leg), and is cancelled when the stream
    ends. `body_iterator` stays public: the fan-out merge reads sub-streams through it.
    """

    media_type = "text/event-stream"
    on_close: Callable[[], None] | None = None      # called when the response ends, even if never started

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None                      # called by the server, inside its task
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()                          # the client left: the stream just ends
        finally:
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()                       # a generator stopped at a yield runs its cleanup now
            if self.on_close is not None:
                self.on_close()
