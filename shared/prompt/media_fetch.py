"""`http(s)://` image URLs, fetched within vLLM's limits (a timeout, a size, `--allowed-media-domains`) and
never into the server's own network unless allowed.

A server that fetches URLs for clients can be turned into a proxy into its network (SSRF: a worker's
admin port, a cloud metadata service, a database on loopback). So, unless the operator allows
private addresses: the host is resolved once, every address it resolves to must be public (not
loopback, private, link-local, multicast, reserved or unspecified), and the connection goes to that
checked address (no second lookup a rebinding DNS server could answer differently). Redirects are
followed by hand, each hop checked the same way. Errors name the URL's host at most, never an
address it resolved to.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 3
_CHUNK = 64 << 10
# an URL's image is sent on to the workers inlined (base64): 8 MiB stays within their 16 MiB body limit
DEFAULT_MAX_MEDIA_BYTES = 8 << 20


@dataclass(frozen=True)
class MediaFetchLimits:
    """What fetching one image URL may cost and reach (vLLM: `--allowed-media-domains`,
    `VLLM_IMAGE_FETCH_TIMEOUT`, the image size limit). Private, loopback and link-local addresses are
    refused unless allowed: a server must not become a proxy into its own network (SSRF)."""

    allowed_domains: tuple[str, ...] = ()        # empty: any public host
    timeout_s: float = 5.0                       # vLLM's image fetch timeout
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    allow_private: bool = False
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_bytes < 1:
            raise ValueError("media fetch needs timeout_s > 0 and max_bytes >= 1")


class MediaFetchError(ValueError):
    """A URL this server will not or could not fetch: the client's 400."""


def fetch_url_bytes(url: str, limits: MediaFetchLimits) -> bytes:
    """The body of `url` (http or https), within `limits`."""
    if not limits.enabled:
        raise MediaFetchError("image URLs are off on this server: send images as data: URLs")
    deadline = time.monotonic() + limits.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = _get_once(url, limits, deadline)
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(url, location)
            continue
        if status != 200:
            raise MediaFetchError(f"image URL on {_host(url)} answered HTTP {status}")
        return body
    raise MediaFetchError(f"image URL on {_host(url)} redirected more than {MAX_REDIRECTS} times")


def _host(url: str) -> str:
    return urlsplit(url).hostname or "?"


def checked_address(url: str, limits: MediaFetchLimits) -> tuple[str, str, int]:
    """(scheme, a public address of the URL's host, port), or MediaFetchError saying why not."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaFetchError("image URLs must be http(s):// or data: URLs")
    host = parts.hostname.lower().rstrip(".")
    if limits.allowed_domains and host not in limits.allowed_domains:
        raise MediaFetchError(f"image URL host {host} is not one of this server's allowed media domains")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        raise MediaFetchError(f"image URL host {host} could not be resolved") from None
    addresses = [str(info[4][0]) for info in infos]
    if not limits.allow_private and any(not _public(address) for address in addresses):
        raise MediaFetchError(f"image URL host {host} is not a public address; this server does not fetch from "
                              "its own network")
    return parts.scheme, addresses[0], port


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback)


def _get_once(url: str, limits: MediaFetchLimits, deadline: float) -> tuple[int, str | None, bytes]:
    scheme, address, port = checked_address(url, limits)
    parts = urlsplit(url)
    host = parts.hostname or ""
    timeout = _left(deadline, url)
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = _PinnedHTTPS(host, address, port, timeout)
    else:
        conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*",
                                           "User-Agent": "kimi-pd"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        return 200, None, _read_bounded(conn, response, limits, deadline, url)
    except (OSError, http.client.HTTPException) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError | socket.timeout) else "could not be fetched"
        raise MediaFetchError(f"image URL on {_host(url)} {reason}") from None
    finally:
        conn.close()


def _left(deadline: float, url: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaFetchError(f"image URL on {_host(url)} timed out")
    return left


def _read_bounded(conn: http.client.HTTPConnection, response: http.client.HTTPResponse, limits: MediaFetchLimits,
                  deadline: float, url: str) -> bytes:
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > limits.max_bytes:
        raise MediaFetchError(f"image URL on {_host(url)} is {declared} bytes, over this server's limit of "
                              f"{limits.max_bytes}")
    body = bytearray()
    while True:
        if conn.sock is not None:
            conn.sock.settimeout(_left(deadline, url))      # the whole fetch within the timeout, not each read
        chunk = response.read(_CHUNK)
        if not chunk:
            break
        body += chunk
        if len(body) > limits.max_bytes:
            raise MediaFetchError(f"image URL on {_host(url)} is over this server's limit of {limits.max_bytes} "
                                  "bytes")
        _left(deadline, url)
    return bytes(body)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a checked address, with the certificate and SNI of the URL's host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)   # type: ignore[attr-defined]
