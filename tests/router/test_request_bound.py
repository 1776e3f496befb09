"""Request bodies over the router's limit are refused before parsing or tokenising (a 413)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from router.app import _bounded_body
from shared.openai.errors import OpenAIError


def request(body: bytes, limit: int, declared: int | None = None) -> Request:
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    app = SimpleNamespace(state=SimpleNamespace(settings=SimpleNamespace(max_request_bytes=limit)))
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "app": app}, receive)


@pytest.mark.parametrize("body,limit,declared", [
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 1000, None),      # read, then refused
    (b"{}", 1000, 5_000_000),                                  # refused on the declared length, unread
])
def test_too_large_bodies_get_413(body, limit, declared):
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_bounded_body(request(body, limit, declared)))
    assert info.value.status == 413 and "larger than 1000 bytes" in info.value.message


def test_bodies_within_the_limit_parse_and_bad_json_is_a_400_error():
    assert asyncio.run(_bounded_body(request(b'{"a": [1, 2]}', 1000))) == ({"a": [1, 2]}, 13)
    with pytest.raises(json.JSONDecodeError):
        asyncio.run(_bounded_body(request(b"{nope", 1000)))
    with pytest.raises(json.JSONDecodeError):
        asyncio.run(_bounded_body(request(b'"\xff"', 1000)))
