"""The data a placement decision reads: one `WorkerState` per candidate and one `RoutingContext`.

Both are immutable. The router builds fresh ones per decision (health, circuit and load change between
requests); plugins never mutate them, so a decision is a pure function of (context, workers).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import NamedTuple

from shared.workers import LoadReport, Role, WorkerInfo


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class WorkerState(NamedTuple):
    """One worker as the router sees it at decision time.

    `load` is the worker's latest engine report, or None when there is none or it is stale (the
    caller decides staleness). `inflight` counts requests THIS router replica has sent and not yet
    seen finish; with N replicas it is roughly 1/N of the truth, so plugins prefer `load`.
    `since_report` is this replica's sends minus finishes on the worker after `load` was sampled,
    so a report taken before a burst finished does not count requests that are gone.
    `backlog_s` is the prefill work this replica sent and has not seen answered (a WorkLedger
    estimate, seconds), `tokens_per_s` the worker's calibrated prefill speed (0: unknown).

    A named tuple, not a frozen dataclass: the router builds one per worker per request, and a frozen
    dataclass's `__init__` (one `object.__setattr__` per field) cost about 8x as much per state.
    """

    info: WorkerInfo
    load: LoadReport | None = None
    inflight: int = 0
    healthy: bool = True
    circuit: CircuitState = CircuitState.CLOSED
    draining: bool = False
    since_report: int = 0
    backlog_s: float = 0.0
    tokens_per_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_draining(self) -> bool:
        """Drained by an operator here, or the worker says it is shutting down."""
        return self.draining or (self.load is not None and self.load.draining)

    @property
    def active_requests(self) -> int:
        """Requests on the worker: the engine's running + waiting brought up to date with what this
        replica sent and saw finish since the report, never below our own in-flight.

        The engine counts every router replica's requests but lags by one heartbeat; our counter is
        current but sees one replica only. Both are lower bounds of the truth, so take the max, after
        correcting the report: a worker that just drained must not look busy for a heartbeat.
        """
        if self.load is None:
            return max(self.inflight, 0)
        return max(self.load.running + self.load.waiting + self.since_report, self.inflight, 0)


class HashKey(NamedTuple):
    """A prefix-hash chain: workers agree on block hashes only if root AND block size are equal.
    A named tuple: placement builds and looks one up for every worker it considers, several times
    per request."""

    hash_root: int
    block_size: int

    @classmethod
    def of(cls, info: WorkerInfo) -> HashKey:
        return cls(info.hash_root, info.block_size)


@dataclass(frozen=True)
class RoutingContext:
    """Everything about one request that placement needs, computed once per request.

    Invariants: `prompt_hashes[k]` holds the hashes of every FULL block of the prompt under chain
    `k` (so `len * k.block_size <= num_prompt_tokens`); `cached_blocks[w] <= len(hashes for w)` is
    the number of those blocks that worker `w` holds as a contiguous chain from block 0, read from
    a prefix index once, so every plugin (scorer, decider) sees the same snapshot. `tail_prefill_s`
    is how long the fleet's long prefills recently took (`WorkLedger.tail_prefill_s`; None: not known yet).
    With a KV pool (router/placement/kv_pool.py), `pooled_blocks[w]` is the pool's leading match for each
    member `w`: blocks it loads instead of computing, each token at `pool_load_cost` of a computed one.
    """

    request_id: str
    model: str
    role: Role
    num_prompt_tokens: int
    prompt_hashes: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)     # HashKey -> ...
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    now: float = 0.0
    tail_prefill_s: float | None = None
    pooled_blocks: Mapping[str, int] = field(default_factory=dict)
    pool_load_cost: float = 0.1
    _uncached: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_hashes", MappingProxyType(dict(self.prompt_hashes)))
        object.__setattr__(self, "cached_blocks", MappingProxyType(dict(self.cached_blocks)))
        object.__setattr__(self, "pooled_blocks", MappingProxyType(dict(self.pooled_blocks)))
        # worker id -> uncached_tokens: filters and scorers ask it of every candidate, several times
        object.__setattr__(self, "_uncached", {})

    def hashes_for(self, info: WorkerInfo) -> tuple[int, ...]:
        # a plain tuple finds the HashKey entry (a named tuple hashes and compares as one), unbuilt:
        # placement asks this for every candidate, several times per request
        return self.prompt_hashes.get((info.hash_root, info.block_size), ())

    def prefix_fraction(self, info: WorkerInfo) -> float:
        """Share of the prompt's full blocks cached on the worker; 0.0 when there are none."""
        total = len(self.hashes_for(info))
        return min(self.cached_blocks.get(info.worker_id, 0), total) / total if total else 0.0

    def uncached_tokens(self, info: WorkerInfo) -> int:
        """Prompt tokens the worker must compute; at least 1 (the engine never serves a whole prompt
        from cache, it needs one computed token for the logits). Kept per worker id: within one
        decision a worker id names one worker, and the context's numbers never change."""
        known = self._uncached.get(info.worker_id)
        if known is not None:
            return known
        cached = self._local_blocks(info)
        if self.pooled_blocks:
            cached = max(cached, self._pooled(info))
        known = self._uncached[info.worker_id] = max(self.num_prompt_tokens - cached * info.block_size, 1)
        return known

    def pool_loaded_tokens(self, info: WorkerInfo) -> int:
        """Prompt tokens the worker would load from the KV pool rather than compute (0 without a pool):
        the pool's chain beyond the worker's own cached prefix."""
        if not self.pooled_blocks:
            return 0
        return max(self._pooled(info) - self._local_blocks(info), 0) * info.block_size

    def work_tokens(self, info: WorkerInfo) -> int:
        """The prefill work this request puts on the worker, in computed-token equivalents: its uncached
        tokens plus its pool loads at their cost (what the work ledger queues)."""
        loaded = self.pool_loaded_tokens(info)
        return self.uncached_tokens(info) + (math.ceil(self.pool_load_cost * loaded) if loaded else 0)

    def _local_blocks(self, info: WorkerInfo) -> int:
        return min(self.cached_blocks.get(info.worker_id, 0), len(self.hashes_for(info)))

    def _pooled(self, info: WorkerInfo) -> int:
        return min(self.pooled_blocks.get(info.worker_id, 0), len(self.hashes_for(info)))
