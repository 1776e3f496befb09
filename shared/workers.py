"""What a worker tells the fleet about itself: identity (registered once) and load (heartbeats)."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal
from urllib.parse import urlsplit

Role = Literal["prefill", "decode", "both"]
ROLES = ("prefill", "decode", "both")
_ID = re.compile(r"[A-Za-z0-9._:@/\-]{1,256}")


class InvalidWorkerRecord(ValueError):
    """A registration or load report that is not what a worker writes (someone else wrote it)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidWorkerRecord(what)


def _is_int(value: Any, lo: int, hi: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def _is_number(value: Any, lo: float, hi: float = math.inf) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def valid_worker_url(url: object) -> bool:
    """An http(s) URL with a host and, if given, a port in 1..65535 (what routers will call)."""
    if not isinstance(url, str) or len(url) > 2048:
        return False
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and (port is None or 0 < port < 65536) \
        and not parts.username and not parts.password


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: Role
    url: str                              # OpenAI-compatible HTTP base, e.g. http://127.0.0.1:8101
    model_id: str                         # served model name
    transfer_host: str = ""
    transfer_port: int = 0
    transfer_engine_id: str = ""
    block_size: int = 16
    capacity_tokens: int = 0
    hash_root: int = 0                    # prefix-hash chain root (shared.hashing.root_hash) of this worker
    started_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> WorkerInfo:
        """Itself, or InvalidWorkerRecord: routers only route to what a real worker could have written."""
        _check(isinstance(self.worker_id, str) and _ID.fullmatch(self.worker_id) is not None, "worker_id")
        _check(self.role in ROLES, "role")
        _check(valid_worker_url(self.url), "url")
        _check(isinstance(self.model_id, str) and 0 < len(self.model_id) <= 256, "model_id")
        _check(isinstance(self.transfer_host, str) and len(self.transfer_host) <= 255, "transfer_host")
        _check(_is_int(self.transfer_port, 0, 65535), "transfer_port")
        _check(isinstance(self.transfer_engine_id, str) and len(self.transfer_engine_id) <= 256, "transfer_engine_id")
        _check(_is_int(self.block_size, 1, 1 << 16), "block_size")
        _check(_is_int(self.capacity_tokens, 0) and _is_int(self.hash_root, 0, (1 << 64) - 1), "capacity/hash_root")
        _check(_is_number(self.started_at, 0.0), "started_at")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerInfo:
        """Parse and validate (InvalidWorkerRecord for anything a worker would not write)."""
        _check(isinstance(d, dict), "not an object")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known).validate()
        except TypeError as exc:                       # a required field missing
            raise InvalidWorkerRecord(str(exc)) from None


@dataclass(frozen=True)
class LoadReport:
    running: int = 0
    waiting: int = 0
    held: int = 0                         # prefill states waiting to be pulled
    cache_usage: float = 0.0              # 0..1 of the MLA page pool
    capacity_tokens: int = 0
    draining: bool = False
    ts: float = 0.0
    engine_busy_s: float = 0.0            # how long the engine has been inside one command or step: stuck if large
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadReport:
        """Parse and validate (InvalidWorkerRecord when a count, fraction or flag has the wrong kind)."""
        _check(isinstance(d, dict), "load is not an object")
        report = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        for f in fields(cls):
            value = getattr(report, f.name)
            ok = {"cache_usage": lambda v: _is_number(v, 0.0, 1.0), "ts": lambda v: _is_number(v, 0.0),
                  "engine_busy_s": lambda v: _is_number(v, 0.0),
                  "draining": lambda v: isinstance(v, bool), "extra": lambda v: isinstance(v, dict)}.get(
                f.name, lambda v: _is_int(v, 0))(value)
            _check(ok, f"load.{f.name}")
        return report
