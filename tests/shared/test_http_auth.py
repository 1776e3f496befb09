"""Bearer tokens are read as HTTP defines the scheme: case-insensitive."""
from __future__ import annotations

import pytest
from starlette.requests import Request

from shared.http import bearer_token


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
