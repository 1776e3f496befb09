"""Tenants: who a request belongs to and what it may use, from a TOML or JSON file the router re-reads
when it changes (docs/admission.md).

    [tenants.acme]                # name: letters, digits, . _ - (a metrics label: at most 64 tenants get one)
    keys = ["sk-acme-..."]        # API keys of this tenant (never logged)
    rpm = 600                     # requests per minute (absent: unlimited)
    tpm = 200000                  # tokens per minute: prompt + max_tokens reserved, settled to what was used
    priority = 0                  # class: lower is served first (router queue and worker scheduler)
    queue_timeout_s = 10          # longest wait in the admission queue (default: the router's)

A tenant named `default` takes keyless requests and the keys of $KIMI_PD_API_KEYS; without one they
are unlimited. Keys are compared as SHA-256 digests, every one of them on each lookup, in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DEFAULT = "default"
MAX_LABELLED = 64                                # tenants with their own metric label; the rest are "other"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FIELDS = {"keys", "rpm", "tpm", "priority", "queue_timeout_s"}
PRIORITY_SPAN = 1 << 20                          # a class is worth more than any request priority


@dataclass(frozen=True)
class Tenant:
    name: str
    rpm: int | None = None
    tpm: int | None = None
    priority: int = 0
    queue_timeout_s: float | None = None
    keys: tuple[str, ...] = field(default=(), repr=False)

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def effective_priority(self, request_priority: int) -> int:
        """What the workers see: the class first, then the request's own (clamped inside the class)."""
        inner = max(-PRIORITY_SPAN // 2 + 1, min(PRIORITY_SPAN // 2 - 1, request_priority))
        return self.priority * PRIORITY_SPAN + inner if self.priority else inner


UNLIMITED = Tenant(DEFAULT)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantConfigError(ValueError):
    """A tenants file the router refuses (at start-up: it does not start; on reload: it keeps the old one)."""


def _positive_int(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TenantConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def _tenant(name: str, raw: Any) -> Tenant:
    where = f"tenant {name!r}"
    if not _NAME.fullmatch(name):
        raise TenantConfigError(f"{where}: names are 1-64 letters, digits, '.', '_' or '-'")
    if not isinstance(raw, dict):
        raise TenantConfigError(f"{where}: expected a table of settings")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise TenantConfigError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(_FIELDS))}")
    keys = raw.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and len(k.strip()) >= 8 for k in keys):
        raise TenantConfigError(f"{where}: keys must be a list of strings of at least 8 characters")
    priority = raw.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 1000:
        raise TenantConfigError(f"{where}: priority must be an integer in -1000..1000")
    timeout = raw.get("queue_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise TenantConfigError(f"{where}: queue_timeout_s must be a positive number of seconds")
    return Tenant(name, _positive_int(where, "rpm", raw.get("rpm")), _positive_int(where, "tpm", raw.get("tpm")),
                  priority, None if timeout is None else float(timeout), tuple(k.strip() for k in keys))


def parse_tenants(text: str, suffix: str) -> dict[str, Tenant]:
    """Tenants by name from a file's text (`.json` is JSON, anything else TOML); refuses bad configs."""
    try:
        data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TenantConfigError(f"not valid {'JSON' if suffix == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"tenants"} or not isinstance(data.get("tenants", {}), dict):
        raise TenantConfigError("expected one table, [tenants.NAME], per tenant and nothing else at the top")
    tenants = {name: _tenant(name, raw) for name, raw in data.get("tenants", {}).items()}
    seen: dict[bytes, str] = {}
    for t in tenants.values():
        for k in t.keys:
            other = seen.setdefault(_digest(k), t.name)
            if other != t.name or sum(x == k for x in t.keys) > 1:
                raise TenantConfigError(f"tenants {other!r} and {t.name!r}: one API key is listed twice")
    return tenants


class Tenants:
    """The tenant of each API key; re-reads its file (checked at most once a second) when it changes."""

    def __init__(self, path: str | None, client_keys: tuple[str, ...] = (), clock=time.monotonic) -> None:
        self.path, self._clock = (Path(path) if path else None), clock
        self._client_keys = tuple(_digest(k) for k in client_keys)
        self._mtime: float | None = None
        self._checked = -1e18
        self.by_name: dict[str, Tenant] = {}
        self._keys: tuple[tuple[bytes, Tenant], ...] = ()
        self._labelled: frozenset[str] = frozenset({DEFAULT})
        if self.path is not None:
            self._load(first=True)

    @property
    def keys_required(self) -> bool:
        return bool(self._client_keys or self._keys)

    @property
    def default(self) -> Tenant:
        return self.by_name.get(DEFAULT, UNLIMITED)

    def resolve(self, token: str) -> Tenant | None:
        """The tenant of `token` (every key compared, in constant time); the default tenant when keys are
        not required; None: refuse (401)."""
        self.maybe_reload()
        presented = _digest(token)
        found: Tenant | None = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(presented, digest):
                found = tenant
        client = False
        for digest in self._client_keys:
            client |= hmac.compare_digest(presented, digest)
        if found is not None:
            return found
        return self.default if client or not self.keys_required else None

    def open_to_all(self) -> bool:
        """No key is required (none configured, the file re-read if due): `resolve` needs no token."""
        self.maybe_reload()
        return not self.keys_required

    def label(self, tenant: Tenant) -> str:
        """A metrics label: bounded cardinality whatever the file holds."""
        return tenant.name if tenant.name in self._labelled else "other"

    def maybe_reload(self) -> None:
        now = self._clock()
        if self.path is None or now - self._checked < 1.0:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except OSError as exc:
            log.error("tenants file %s unreadable (%s); keeping the tenants loaded before", self.path, exc.strerror)
            return
        if mtime != self._mtime:
            self._load(first=False)

    def _load(self, first: bool) -> None:
        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime
            tenants = parse_tenants(self.path.read_text(), self.path.suffix)
        except (OSError, TenantConfigError) as exc:
            message = exc.strerror if isinstance(exc, OSError) else str(exc)
            if first:
                raise TenantConfigError(f"tenants file {self.path}: {message}") from None
            log.error("tenants file %s refused (%s); keeping the tenants loaded before", self.path, message)
            self._mtime = os.stat(self.path).st_mtime if self.path.exists() else None
            return
        self._mtime, self.by_name = mtime, tenants
        self._keys = tuple((_digest(k), t) for t in tenants.values() for k in t.keys)
        self._labelled = frozenset({DEFAULT, *sorted(tenants)[:MAX_LABELLED]})
        log.info("tenants file %s: %d tenants (%s)", self.path, len(tenants), ", ".join(sorted(tenants)[:10]))
