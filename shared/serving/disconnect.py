"""Run a coroutine until it finishes or the HTTP client goes away (then cancel it)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from shared.openai.errors import OpenAIError

T = TypeVar("T")
POLL_S = 0.25


class ClientDisconnected(OpenAIError):
    status = 499
    code = "client_disconnected"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Cancelling `work` lets it clean up (abort engine requests, close upstream connections)."""
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
