"""HTTP calls to workers, with failures classified so the orchestrator can decide what to retry.

Only a failure to *connect* (the worker never saw the request) is retried on another worker; a
worker that accepted the request and then failed is never retried with the same transfer params.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from router.transport.worker_http import (
    KEEPALIVE_S,
    ConnectFailed,
    Disconnected,
    Origin,
    ReadTimeout,
    UnsendableRequest,
    WorkerClient,
    WorkerHTTPError,
)

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


# what a failed call to a worker can raise: router.transport.worker_http on the request path,
# httpx on admin/health calls
TRANSPORT_ERRORS = (WorkerHTTPError, asyncio.TimeoutError, httpx.HTTPError)

# the worker closed the connection (or reset it) before any response: a pooled keep-alive connection
# it was closing as we reused it, or a worker that died on receipt; nothing was answered
DISCONNECTED = (Disconnected, httpx.RemoteProtocolError)


def classify(exc: BaseException, leg: str, replay_safe: bool = False) -> UpstreamError:
    """Client-facing messages name the leg, never internal addresses (those go to the log)."""
    log.warning("%s worker call failed: %s: %s", leg, type(exc).__name__, exc)
    if isinstance(exc, (httpx.LocalProtocolError, httpx.UnsupportedProtocol, httpx.InvalidURL, UnsendableRequest)):
        # the request could not be built or sent: the router's problem, never the worker's
        return UpstreamError("request", f"the {leg} request could not be sent", 500, worker_fault=False)
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, ConnectFailed)):
        return UpstreamError("connect", f"the {leg} worker could not be reached", 503, retryable=True)
    if replay_safe and isinstance(exc, DISCONNECTED):
        # nothing came back, and replaying is harmless (no transfer params a worker may have consumed)
        return UpstreamError("disconnected", f"the {leg} worker closed the connection", 502, retryable=True)
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError, ReadTimeout)):
        return UpstreamError("timeout", f"the {leg} worker timed out", 504)
    return UpstreamError("transport", f"the {leg} worker connection failed", 502)


@dataclass(frozen=True)
class LegTimeout:
    """Connect bound and the longest wait for the next bytes; no bound on the whole call here."""

    connect_s: float
    read_s: float


def leg_timeout(connect_s: float, read_s: float) -> LegTimeout:
    return LegTimeout(connect_s, read_s)


def make_session() -> WorkerClient:
    """The pooled client of the request path (router.transport.worker_http: httptools parser, keep-alive, raw
    bytes: bodies are relayed, never re-encoded)."""
    return WorkerClient(KEEPALIVE_S)


def dumps(body: Any) -> bytes:
    return orjson.dumps(body)


def error_body(resp_content: bytes) -> dict | None:
    try:
        body = orjson.loads(resp_content)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) and "error" in body else None


@dataclass
class JsonReply:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str]


async def post_json(client: WorkerClient, origin: Origin, path: str, body: dict, timeout: LegTimeout,
                    headers: dict[str, str], leg: str) -> JsonReply:
    """POST and parse; non-2xx replies come back as UpstreamError carrying the worker's error body."""
    try:
        resp = await client.post(origin, path, dumps(body), headers, connect_timeout=timeout.connect_s,
                                 read_timeout=timeout.read_s)
        try:
            content = await resp.read()
        except BaseException:
            resp.close()
            raise
        resp.release()
        status, reply_headers = resp.status, resp.headers
    except TRANSPORT_ERRORS as exc:
        raise classify(exc, leg, replay_safe=True) from exc
    if status >= 400:
        raise UpstreamError(f"http_{status // 100}xx", f"the {leg} worker answered {status}",
                            status, error_body(content), retryable=status in (502, 503))
    return JsonReply(status, parse_object(content, leg), reply_headers)


def parse_object(content: bytes, leg: str) -> dict[str, Any]:
    """A worker's 2xx JSON body; anything else is the worker's fault (502), never the client's."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise UpstreamError("bad_reply", f"the {leg} worker sent a malformed reply", 502)
    return body
