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
from engine.structured_output import GrammarBudget
from shared.env import ADMIN_TOKEN_ENV, CLIENT_KEYS_ENV
from shared.openai.surface import SurfaceOptions

TRANSFER_SECRET_ENV = "KIMI_PD_TRANSFER_SECRET"
API_KEY_ENV = "KIMI_PD_API_KEY"
INTERNAL_AUTH_ENV = "KIMI_PD_INTERNAL_AUTH"
WILDCARDS = ("0.0.0.0", "::", "")                # bind addresses that name no host another one can reach


def internal_auth_default() -> bool:
    """On when the fleet has client keys or it is asked for: a client must not go around the router."""
    return bool(os.environ.get(CLIENT_KEYS_ENV, "").strip()) or \
        os.environ.get(INTERNAL_AUTH_ENV, "").lower() in ("1", "true", "yes")


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
    transfer_host: str = "127.0.0.1"             # where the transfer server binds
    transfer_advertise_host: str | None = None    # what decode workers are told to pull from (default: the bind)
    transfer_port: int = 0
    transfer_streams: int = 2
    transfer_secret: bytes = field(default=b"", repr=False)
    kv_lease_s: float = 30.0
    kv_renewed_lease_s: float = 5.0               # a state its router renews lives this long past each renewal
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    store_url: str | None = None
    namespace: str = "default"
    heartbeat_s: float = 1.0
    registration_ttl_s: float = 5.0
    max_request_bytes: int = 16 << 20             # above the router's limit: what it forwards always fits
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)   # structured output's size and time
    internal_auth: bool = False                   # OpenAI endpoints need the internal token (or api_key)
    api_key: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    enable_auto_tool_choice: bool = True          # off: tool_choice "auto" is a 400, as in vLLM without the flag
    surface: SurfaceOptions = field(default_factory=SurfaceOptions)   # vLLM's request-surface flags

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    @property
    def transfer_address(self) -> str:
        """The transfer host other workers connect to: never a wildcard, which they would read as themselves."""
        return self.transfer_advertise_host or self.transfer_host

    def validate(self) -> None:
        if self.internal_auth and not self.admin_token:
            raise ValueError(f"internal auth is on (the fleet has client keys): set {ADMIN_TOKEN_ENV}, the token "
                             "routers authenticate with")
        if self.transfer_address in WILDCARDS:
            raise ValueError(f"--kv-host {self.transfer_host} listens on every interface: give --kv-advertise-host, "
                             "the address decode workers on other hosts reach this one at")
        if self.store_url and not self.advertise_url and self.host in WILDCARDS:
            raise ValueError(f"--host {self.host} listens on every interface: give --advertise-url, the URL routers on "
                             "other hosts reach this worker at (it is registered in the store)")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be recompute or fail")
        self.engine.validate()
