"""HTTP helpers both services use: JSON bodies, bearer tokens, the one error mapping, disconnects."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from shared.errors import EngineError
from shared.openai.errors import OpenAIError, error_from_exception

T = TypeVar("T")
POLL_S = 0.25
# Expected failures are handled as responses; anything else still gets the OpenAI 500 body (and a log).
HANDLED_ERRORS = (RequestValidationError, ValidationError, json.JSONDecodeError, OpenAIError, EngineError,
                  ValueError, TimeoutError, Exception)


class ClientDisconnected(OpenAIError):
    status = 499
    code = "client_disconnected"


async def read_json_body(request: Request) -> Any:
    """The request's JSON body; malformed JSON or non-UTF-8 bytes raise JSONDecodeError (-> 400)."""
    try:
        return json.loads(await request.body())
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError("not UTF-8", "", 0) from exc


def bearer_token(request: Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ").strip()


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None] | None = None) -> None:
    """Every error leaves as an OpenAI error body with its status; `on_error` sees each (for metrics)."""
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_from_exception(exc)
        if on_error is not None:
            on_error(request, status)
        return JSONResponse(body.model_dump(mode="json"), status_code=status)

    for cls in HANDLED_ERRORS:
        app.add_exception_handler(cls, handler)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` until it finishes or the client goes away; cancelling it lets it clean up (abort
    engine requests, close upstream connections)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientDisconnected("client disconnected")
    finally:
        if not task.done():
            task.cancel()
