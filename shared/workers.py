"""What a worker tells the fleet about itself: identity (registered once) and load (heartbeats)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkerInfo":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class LoadReport:
    running: int = 0
    waiting: int = 0
    held: int = 0                         # prefill states waiting to be pulled
    cache_usage: float = 0.0              # 0..1 of the MLA page pool
    capacity_tokens: int = 0
    draining: bool = False
    ts: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoadReport":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
