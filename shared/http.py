"""HTTP helpers both services use: JSON bodies, bearer tokens, the one error mapping, disconnects."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from shared.errors import EngineError
from shared.openai.errors import BadRequest, OpenAIError, error_from_exception

T = TypeVar("T")
# Expected failures are handled as responses; anything else still gets the OpenAI 500 body (and a log).
# HTTPException: Starlette's own 404/405 (unknown path, wrong method) get the OpenAI body too.
HANDLED_ERRORS = (RequestValidationError, ValidationError, json.JSONDecodeError, OpenAIError, EngineError,
                  HTTPException, ValueError, TimeoutError, Exception)
MAX_JSON_DEPTH = 64               # no OpenAI request nests deeper; deeper ones could exhaust recursion later
BODY_TIMEOUT_S = 30.0             # a whole request body must arrive within this (slow-body clients hold memory)


class BodyTooLarge(OpenAIError):
    status = 413
    code = "request_too_large"


class ClientDisconnected(OpenAIError):
    status = 499
    code = "client_disconnected"


class BodyTimeout(OpenAIError):
    status = 408
    code = "request_timeout"


async def read_body(request: Request, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The raw body, refused with a 413 as soon as it exceeds `max_bytes` (declared or streamed), so
    an oversized upload is never buffered whole, and with a 408 when it has not all arrived within
    `timeout_s` (headers have their own deadline: `shared.http_server`). A client that leaves mid-body
    is a ClientDisconnected, not a server error."""
    declared = header(request, b"content-length") or ""
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the request body is larger than {max_bytes} bytes")
    body = getattr(request, "_body", None)          # already read (the router's front protocol reads it first)
    if isinstance(body, bytes):
        if len(body) > max_bytes:
            raise BodyTooLarge(f"the request body is larger than {max_bytes} bytes")
        return body
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"the request body is larger than {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection before sending the whole body") from None
    return b"".join(chunks)


def header(request: Request, name: bytes) -> str | None:
    """The first value of header `name` (lower-case bytes), read from the ASGI scope: cheaper than
    building Starlette's `Headers`, which decodes every header on each lookup."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def parse_json(body: bytes) -> Any:
    """Strict JSON: UTF-8 only, no lone surrogates, no NaN/Infinity, numbers that fit a double, at most
    MAX_JSON_DEPTH levels. Anything else is the client's 400, never a server error later on."""
    try:
        value = orjson.loads(body)
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise json.JSONDecodeError(str(exc) if isinstance(exc, orjson.JSONDecodeError) else "nested too deeply",
                                   "", 0) from None
    if _too_deep(value):
        raise BadRequest(f"The request body nests more than {MAX_JSON_DEPTH} levels deep")
    return value


def _too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(MAX_JSON_DEPTH + 1):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return True


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON body (see `parse_json`); larger than `max_bytes`: 413."""
    return parse_json(await read_body(request, max_bytes))


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """A body that must be a JSON object (admin and internal endpoints)."""
    body = await read_json_body(request, max_bytes)
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def bearer_token(request: Request) -> str:
    """The credentials of an `Authorization: Bearer ...` header; the scheme is case-insensitive (RFC 9110),
    so `bearer` works as clients send it. A header without a scheme is taken whole, as before."""
    scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else scheme


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None] | None = None) -> None:
    """Every error leaves as an OpenAI error body with its status; `on_error` sees each (for metrics)."""
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_from_exception(exc)
        if on_error is not None:
            on_error(request, status)
        return JSONResponse(body.model_dump(mode="json"), status_code=status)

    for cls in HANDLED_ERRORS:
        app.add_exception_handler(cls, handler)


# a server that cancels a request's task itself when its client goes away puts an object with a
# `disconnected` flag and the request's `task` under this key of the ASGI scope's "extensions"
# (router.transport.front): then no watcher task is needed
DISCONNECT_EXTENSION = "kimi-pd.cancel-on-disconnect"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` until it finishes or the client goes away; cancelling it lets it clean up (abort
    engine requests, close upstream connections).

    `work` runs in the caller's task; one watcher task waits on the ASGI `receive` for the
    server's `http.disconnect` and cancels the caller (no polling, no second task for the work:
    both cost CPU on every request of the hot path). Call it once the body has been read."""
    task = asyncio.current_task()
    if task is None:  # only a coroutine running outside any task (never under an ASGI server)
        raise RuntimeError("until_disconnect must be awaited inside a task")
    server = request.scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
    if server is not None and server.task is task:
        try:
            return await work
        except asyncio.CancelledError:
            if not server.disconnected:
                raise
            task.uncancel()
            raise ClientDisconnected("client disconnected") from None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientDisconnected("client disconnected") from None
    finally:
        watcher.cancel()
    if gone:                          # the work swallowed the cancellation: the client is gone all the same
        if task.cancelling():
            task.uncancel()
        raise ClientDisconnected("client disconnected")
    return result
