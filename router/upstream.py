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

import aiohttp
import httpx
import orjson

log = logging.getLogger(__name__)

class UpstreamError(Exception):
    def __init__(self, reason: str, message: str, status: int = 502, body: dict | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.status, self.body, self.retryable = reason, message, status, body, retryable


# what a failed call to a worker can raise: aiohttp on the request path, httpx on admin/health calls
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, httpx.HTTPError)
JSON_HEADERS = {"content-type": "application/json"}


def classify(exc: BaseException, leg: str) -> UpstreamError:
    """Client-facing messages name the leg, never internal addresses (those go to the log)."""
    log.warning("%s worker call failed: %s: %s", leg, type(exc).__name__, exc)
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, aiohttp.ClientConnectorError,
                        aiohttp.ConnectionTimeoutError)):
        return UpstreamError("connect", f"the {leg} worker could not be reached", 503, retryable=True)
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        return UpstreamError("timeout", f"the {leg} worker timed out", 504)
    return UpstreamError("transport", f"the {leg} worker connection failed", 502)


def leg_timeout(connect_s: float, read_s: float) -> aiohttp.ClientTimeout:
    """Connect bound and the longest wait for the next bytes; no bound on the whole call here."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)


def make_session(connections: int = 1000) -> aiohttp.ClientSession:
    """The pooled client of the request path (C HTTP parser, keep-alive, no cookie jar, raw bytes:
    bodies are relayed, never re-encoded)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, ttl_dns_cache=300,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 cookie_jar=aiohttp.DummyCookieJar(), json_serialize=lambda o: orjson.dumps(o).decode())


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


async def post_json(session: aiohttp.ClientSession, url: str, body: dict, timeout: aiohttp.ClientTimeout,
                    headers: dict[str, str], leg: str) -> JsonReply:
    """POST and parse; non-2xx replies come back as UpstreamError carrying the worker's error body."""
    try:
        async with session.post(url, data=dumps(body), timeout=timeout, headers={**JSON_HEADERS, **headers}) as resp:
            content = await resp.read()
            status, reply_headers = resp.status, resp.headers
    except TRANSPORT_ERRORS as exc:
        raise classify(exc, leg) from exc
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
