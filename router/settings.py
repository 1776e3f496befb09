"""Router settings: one frozen dataclass, parsed once at the process edge."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterSettings:
    model: str                                    # checkpoint dir: tokenizer + config (for prompt hashing)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kimi-k3"
    static_prefill: tuple[str, ...] = ()          # worker URLs given on the command line
    static_decode: tuple[str, ...] = ()
    static_both: tuple[str, ...] = ()
    block_size: int = 16                          # for static workers (discovered ones report theirs)
    store_url: str | None = None
    namespace: str = "default"
    refresh_s: float = 0.5                        # registry + KV event polling
    store_empty_grace_s: float = 10.0             # a store that lists nobody: keep the last fleet this long
    health_check_s: float = 2.0
    disagg_threshold_tokens: int = 32             # below this many uncached tokens on D: decode-only
    connect_timeout_s: float = 2.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0               # whole decode leg
    idle_timeout_s: float = 60.0                  # longest gap between two streamed chunks
    max_attempts: int = 3                         # connect failures retried on a different worker
    max_request_bytes: int = 4 << 20              # larger bodies get a 413 before any parsing or tokenising
    approximate_index_blocks: int = 65536
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    worker_api_key: str | None = field(default=None, repr=False)   # sent to workers that require a key
    admin_token: str | None = field(default=None, repr=False)
    scorer_weights: tuple[tuple[str, float], ...] = (("prefix", 1.0), ("load", 1.0), ("kv_usage", 0.5))

    def validate(self) -> None:
        if not (self.static_prefill or self.static_decode or self.static_both or self.store_url):
            raise ValueError("give workers (--prefill/--decode/--worker URLs) or a state store (--redis-url)")
        if self.api_keys and not (self.admin_token or self.worker_api_key):
            raise ValueError("client API keys are on, so calls to workers must be authenticated too: set "
                             "KIMI_PD_ADMIN_TOKEN (or KIMI_PD_WORKER_API_KEY)")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
