"""Worker settings: one frozen dataclass, parsed once at the process edge (CLI flags + environment).
The role is not a setting: it is the `Role` the service is started with (`worker.role`).

Secrets (transfer HMAC key, API keys) come from the environment or files, never from argv-visible
defaults, and are excluded from `repr` so they cannot reach logs.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Literal

from engine.core.engine import EngineConfig

TRANSFER_SECRET_ENV = "KIMI_PD_TRANSFER_SECRET"
ADMIN_TOKEN_ENV = "KIMI_PD_ADMIN_TOKEN"
API_KEY_ENV = "KIMI_PD_API_KEY"


def secret_from_env(name: str, required: bool = False) -> str | None:
    value = os.environ.get(name)
    if required and not value:
        raise ValueError(f"set {name} (a shared secret, at least 16 characters)")
    return value


@dataclass(frozen=True)
class WorkerSettings:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: str = "kimi-k3"
    worker_id: str = field(default_factory=lambda: f"w-{secrets.token_hex(4)}")
    advertise_url: str | None = None
    transfer_transport: str = "tcp"
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    transfer_streams: int = 2
    transfer_secret: bytes = field(default=b"", repr=False)
    kv_lease_s: float = 30.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    store_url: str | None = None
    namespace: str = "default"
    heartbeat_s: float = 1.0
    registration_ttl_s: float = 5.0
    api_key: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    def validate(self) -> None:
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be recompute or fail")
        self.engine.validate()
