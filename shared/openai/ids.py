"""Request ids a client may give (`request_id` in the body, `x-request-id` header).

A client's id is only a label for its own tracing: it must be safe in an HTTP header and a log line,
so it is printable ASCII without spaces, at most `MAX_REQUEST_ID_CHARS` long. The ids the services
use internally (engine requests, transfer leases, the router's legs) are their own, never the client's.
"""
from __future__ import annotations

import re

MAX_REQUEST_ID_CHARS = 128
_SAFE = re.compile(rf"[!#-~]{{1,{MAX_REQUEST_ID_CHARS}}}")       # printable ASCII, no space, no '"'


GROUP_HEADER = "x-kimi-pd-group"        # router -> worker: the fan-out a sub-request belongs to
LEASE_RENEW_HEADER = "x-kimi-pd-lease-renew"   # router -> prefill worker: "1": it renews the state's lease


def is_safe_request_id(value: object) -> bool:
    return isinstance(value, str) and _SAFE.fullmatch(value) is not None


def header_request_id(value: str | None) -> str | None:
    """A client's `x-request-id` header when it is safe, else None (dropped, never an error: headers
    are often added by proxies the client does not control)."""
    return value if is_safe_request_id(value) else None
