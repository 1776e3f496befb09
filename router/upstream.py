"""HTTP calls to workers, with failures classified so the orchestrator can decide what to retry.

Only a failure to *connect* (the worker never saw the request) is retried on another worker; a
worker that accepted the request and then failed is never retried with the same transfer params.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

class UpstreamError(Exception):
    """A failed call to a worker. `worker_fault` says whether it is evidence against the worker's
    health (the circuit breaker counts it); a request that could not even be sent is not."""

    def __init__(self, reason: str, message: str, status: int = 502, body: dict | None = None,
                 retryable: bool = False, worker_fault: bool | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.status, self.body, self.retryable = reason, message, status, body, retryable
        self.worker_fault = status >= 500 or retryable if worker_fault is None else worker_fault

    @property
    def health_outcome(self) -> bool | None:
        """What the breaker records: False for the worker's fault, True for a 4xx it answered (it is
        alive; the client was wrong), None when the call says nothing about the worker."""
        if self.worker_fault:
            return False
        return True if self.status < 500 else None


def classify(exc: Exception, leg: str) -> UpstreamError:
    """Client-facing messages name the leg, never internal addresses (those go to the log)."""
    log.warning("%s worker call failed: %s: %s", leg, type(exc).__name__, exc)
    if isinstance(exc, (httpx.LocalProtocolError, httpx.UnsupportedProtocol, httpx.InvalidURL)):
        # the request could not be built or sent: the router's problem, never the worker's
        return UpstreamError("request", f"the {leg} request could not be sent", 500, worker_fault=False)
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamError("connect", f"the {leg} worker could not be reached", 503, retryable=True)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("timeout", f"the {leg} worker timed out", 504)
    return UpstreamError("transport", f"the {leg} worker connection failed", 502)


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
                    headers: dict[str, str], leg: str) -> JsonReply:
    """POST and parse; non-2xx replies come back as UpstreamError carrying the worker's error body."""
    try:
        resp = await client.post(url, json=body, timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise classify(exc, leg) from exc
    if resp.status_code >= 400:
        parsed = error_body(resp.content)
        raise UpstreamError(f"http_{resp.status_code // 100}xx", f"the {leg} worker answered {resp.status_code}",
                            resp.status_code, parsed, retryable=resp.status_code in (502, 503))
    return JsonReply(resp.status_code, parse_object(resp.content, leg), resp.headers)


def parse_object(content: bytes, leg: str) -> dict[str, Any]:
    """A worker's 2xx JSON body; anything else is the worker's fault (502), never the client's."""
    try:
        body = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        raise UpstreamError("bad_reply", f"the {leg} worker sent a malformed reply", 502)
    return body
