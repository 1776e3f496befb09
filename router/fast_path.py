"""The request path's ASGI shortcut: POST /v1/chat/completions and /v1/completions go straight to
their handlers, past FastAPI's routing, dependency and exception layers.

Those handlers already own their validation and errors, and the layers they skip cost more CPU
per request than the router's own work (benchmarks/router_overhead.py, py-spy). Exceptions are
rendered by the app's own exception handlers (looked up along the exception's MRO, as Starlette
does), so a client sees exactly the responses the routed path gives. Everything else - other
paths and methods, lifespan, websockets - passes through to the app unchanged.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class FastPath:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app, self.routes = app, dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:                     # noqa: BLE001 - rendered like the routed path does
            response = await self._render(request, exc)
        await response(scope, receive, send)

    @staticmethod
    async def _render(request: Request, exc: Exception) -> Response:
        handlers = request.app.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return await handlers[cls](request, exc)
        raise exc
