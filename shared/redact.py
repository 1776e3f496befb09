"""One way to show a URL that may carry credentials (a store URL) in logs and errors."""
from __future__ import annotations

from urllib.parse import urlsplit


def redact_url(url: str) -> str:
    """`url` without credentials or query, for logs and errors."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"
