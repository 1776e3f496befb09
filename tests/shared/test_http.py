"""The HTTP edge both services share: bearer tokens read as HTTP defines the scheme (case-insensitive), and
request bodies bounded in time as well as size."""
from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from shared.http import BodyTimeout, ClientDisconnected, bearer_token, read_body
from shared.openai.errors import error_from_exception


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "headers": headers})


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer sk-1", "sk-1"),
    ("bearer sk-1", "sk-1"),
    ("BEARER  sk-1 ", "sk-1"),
    ("sk-1", "sk-1"),                 # no scheme: the header whole, as before
    ("Basic dXNlcjpwdw==", "Basic"),  # another scheme never yields its credentials as a bearer token
    (None, ""),
])
def test_bearer_token(header: str | None, token: str) -> None:
    assert bearer_token(_request(header)) == token


def _streaming_request(receive) -> Request:
    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_a_body_that_trickles_in_past_its_deadline_is_a_408() -> None:
    async def trickle():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"{", "more_body": True}

    with pytest.raises(BodyTimeout, match="did not arrive within 0.3 s"):
        asyncio.run(read_body(_streaming_request(trickle), max_bytes=1 << 20, timeout_s=0.3))


def test_a_client_that_leaves_mid_body_is_a_499_not_a_server_error() -> None:
    messages = iter([{"type": "http.request", "body": b'{"a":', "more_body": True}, {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    with pytest.raises(ClientDisconnected) as err:
        asyncio.run(read_body(_streaming_request(receive), max_bytes=1 << 20))
    assert error_from_exception(err.value)[0] == 499


def test_a_body_in_time_is_read_whole() -> None:
    parts = iter([b'{"a":', b" 1}"])

    async def receive():
        chunk = next(parts)
        return {"type": "http.request", "body": chunk, "more_body": chunk != b" 1}"}

    assert asyncio.run(read_body(_streaming_request(receive), max_bytes=1 << 20, timeout_s=5)) == b'{"a": 1}'
