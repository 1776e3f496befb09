"""Router settings: one frozen dataclass, parsed once at the process edge."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from router.placement.kv_pool import KVPoolConfig
from shared.openai.surface import SurfaceOptions


@dataclass(frozen=True)
class RouterSettings:
    model: str | None                             # K3 checkpoint or HF tokenizer dir (prompt hashing); None: text
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kimi-k3"            # the workers' name: what the router sends them
    served_model_aliases: tuple[str, ...] = ()    # more names clients may use (vLLM's --served-model-name A B)
    kv_connector: str = "kimi-pd"                 # the P/D protocol of static workers (router/connectors.py)
    mooncake_bootstrap_port: int = 8998           # upstream Mooncake: a prefill's bootstrap server port
    kv_events: tuple[tuple[str, str], ...] = ()   # (static worker URL, vLLM ZMQ endpoint): exact prefix index
    static_prefill: tuple[str, ...] = ()          # worker URLs given on the command line
    static_decode: tuple[str, ...] = ()
    static_both: tuple[str, ...] = ()
    # (static worker URL, D): one API server in front of D data-parallel ranks (vLLM's internal DP load
    # balancing): placed on as D workers, `<URL>#dp<r>`, each request pinned by `X-data-parallel-rank`
    static_dp_ranks: tuple[tuple[str, int], ...] = ()
    block_size: int = 16                          # for static workers (discovered ones report theirs)
    store_url: str | None = None
    namespace: str = "default"
    refresh_s: float = 0.5                        # registry + KV event polling
    store_empty_grace_s: float = 10.0             # a store that lists nobody: keep the last fleet this long
    health_check_s: float = 2.0
    health_timeout_s: float = 2.0                 # per probe; a busy worker answers /health late, not never
    disagg_threshold_tokens: int = 32             # below this many uncached tokens on D: decode-only
    # above the threshold, also decode-only when moving the state is expected to take longer than D prefilling
    # it (router/placement/transfer.py); off: the threshold alone decides
    transfer_aware: bool = False
    connect_timeout_s: float = 2.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0               # whole decode leg
    idle_timeout_s: float = 60.0                  # longest gap between two streamed chunks
    max_attempts: int = 3                         # connect failures retried on a different worker
    max_request_bytes: int = 4 << 20               # larger bodies get a 413 before any parsing or tokenising
    max_sequences_per_request: int = 1024          # prompts x n (best_of) of one request; more: a 400
    approximate_index_blocks: int = 65536         # per static worker whose cache size is unknown
    static_cache_tokens: int = 0                  # KV cache of each static worker (0: ask its /metrics)
    prefill_tokens_per_s: float = 20000.0         # starting guess per worker; the ledger calibrates it
    # a KV pool the prefill workers share (router/placement/kv_pool.py): its capacity in KV blocks (0: none) and
    # what loading a token from it costs, as a share of computing it
    kv_pool_blocks: int = 0
    kv_pool_load_cost: float = 0.1
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # x-kimi-pd-prefill-worker / -decode-worker on answers name the workers a request went to (worker ids,
    # which for static workers are their URLs): for tests and tracing on a trusted network. None: only when
    # no client keys are set, so a fleet that authenticates clients never shows them its internal addresses.
    placement_headers: bool | None = None
    worker_api_key: str | None = field(default=None, repr=False)   # sent to workers that require a key
    admin_token: str | None = field(default=None, repr=False)
    surface: SurfaceOptions = field(default_factory=SurfaceOptions)   # vLLM's request-surface flags (tokenizer
    #                                                                    info, request templates, image URLs)
    # placement (router/placement): expected completion time, in seconds of prefill work, with a
    # recomputed token charged `own_weight` times (it also costs every later request its cache); a
    # worker whose expected completion of the request is more than the slack behind the earliest is
    # skipped (0.8 x the 99th percentile of the last 2000 legs' uncached prefill seconds, `slack_s` until 50
    # legs were sent); request counts guard only against load this replica did not send. Tuned on the first half
    # of the Mooncake traces and measured on the second (benchmarks/placement_replay.py, --tune).
    scorer_weights: tuple[tuple[str, Any], ...] = (("completion", (1.0, (("own_weight", 32.0),))),)
    # admission (docs/admission.md): tenants and their limits; slots per usable decode worker (0: no queue),
    # the queue's bound and its default deadline
    tenants_file: str | None = None
    max_inflight_per_worker: int = 0
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    placement_filters: tuple[Any, ...] = ("model", "role", "healthy", "circuit-not-open", "not-draining", "not-stuck",
                                          ("not-backlogged", (("slack_s", 4.0), ("with_request", True),
                                                              ("tail_share", 0.8))),
                                          ("not-overloaded", (("unseen_only", True),)))

    def pipeline_spec(self) -> dict[str, Any]:
        """`build_pipeline` keyword arguments for the placement policy above."""
        def spec(item):
            return item if isinstance(item, str) else (item[0], dict(item[1]))
        scorers = {name: (w if isinstance(w, (int, float)) else (w[0], dict(w[1]))) for name, w in self.scorer_weights}
        return {"filters": tuple(spec(f) for f in self.placement_filters), "scorers": scorers}

    @property
    def shows_placement(self) -> bool:
        return (not self.api_keys) if self.placement_headers is None else self.placement_headers

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    @cached_property
    def kv_pool(self) -> KVPoolConfig:
        """The KV pool's two flags as the one config placement takes (raises ValueError when out of range)."""
        return KVPoolConfig(self.kv_pool_blocks, self.kv_pool_load_cost)

    def validate(self) -> None:
        from router.connectors import CONNECTORS, connector
        try:
            _ = self.kv_pool                              # building it checks the two flags
        except ValueError as exc:
            raise ValueError(f"--kv-pool-blocks/--kv-pool-load-cost: {exc}") from None
        try:
            connector(self.kv_connector)
        except KeyError:
            raise ValueError(f"unknown --kv-connector {self.kv_connector!r}; one of "
                             f"{', '.join(sorted(CONNECTORS))}") from None
        if not (self.static_prefill or self.static_decode or self.static_both or self.store_url):
            raise ValueError("give workers (--prefill/--decode/--worker URLs) or a state store (--redis-url)")
        if self.api_keys and not (self.admin_token or self.worker_api_key):
            raise ValueError("client API keys are on, so calls to workers must be authenticated too: set "
                             "KIMI_PD_ADMIN_TOKEN (or KIMI_PD_WORKER_API_KEY)")
        unknown = [url for url, _ in self.kv_events
                   if url not in (*self.static_prefill, *self.static_decode, *self.static_both)]
        if unknown:
            raise ValueError(f"--kv-events names workers that are not static workers: {', '.join(unknown)}")
        static = (*self.static_prefill, *self.static_decode, *self.static_both)
        bad = [f"{url}={d}" for url, d in self.static_dp_ranks
               if url not in static or d < 1 or url in dict(self.kv_events)]
        if bad:
            raise ValueError(f"--data-parallel-ranks needs a static worker URL (without --kv-events) and D >= 1: "
                             f"{', '.join(bad)}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 1 <= self.max_sequences_per_request <= 1024:
            raise ValueError("max_sequences_per_request must be in 1..1024")
        if self.max_inflight_per_worker < 0 or self.max_queued < 0 or self.queue_timeout_s <= 0:
            raise ValueError("--max-inflight-per-worker and --max-queued must be >= 0, --queue-timeout > 0")
        if self.prefill_tokens_per_s <= 0 or self.static_cache_tokens < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and static_cache_tokens >= 0")
