"""HTTP calls to workers, with failures classified so the orchestrator can decide what to retry.

Only a failure to *connect* (the worker never saw the request) is retried on another worker; a
worker that accepted the request and then failed is never retried with the same transfer params.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx


class UpstreamError(Exception):
    def __init__(self, reason: str, message: str, status: int = 502, body: dict | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.status, self.body, self.retryable = reason, message, status, body, retryable


def classify(exc: Exception, where: str) -> UpstreamError:
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamError("connect", f"{where}: cannot connect ({type(exc).__name__})", 503, retryable=True)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("timeout", f"{where}: timed out ({type(exc).__name__})", 504)
    return UpstreamError("transport", f"{where}: {type(exc).__name__}: {exc}", 502)


def error_body(resp_content: bytes) -> dict | None:
    try:
        body = json.loads(resp_content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) and "error" in body else None


@dataclass
class JsonReply:
    status: int
    body: dict[str, Any]
    headers: httpx.Headers


async def post_json(client: httpx.AsyncClient, url: str, body: dict, timeout: httpx.Timeout,
                    headers: dict[str, str]) -> JsonReply:
    """POST and parse; non-2xx replies come back as UpstreamError carrying the worker's error body."""
    try:
        resp = await client.post(url, json=body, timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise classify(exc, url) from exc
    if resp.status_code >= 400:
        parsed = error_body(resp.content)
        message = parsed["error"].get("message", "") if parsed else resp.text[:200]
        raise UpstreamError(f"http_{resp.status_code // 100}xx", f"{url}: {resp.status_code} {message}",
                            resp.status_code, parsed, retryable=resp.status_code in (502, 503))
    try:
        return JsonReply(resp.status_code, resp.json(), resp.headers)
    except json.JSONDecodeError as exc:
        raise UpstreamError("bad_json", f"{url}: reply is not JSON", 502) from exc
