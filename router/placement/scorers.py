"""Scorers: pure `(ctx, workers) -> one float per worker`, where higher is better.

Contract: a scorer returns exactly one value per input worker, in input order. Values are meant to
lie in [0, 1]; `run_scorer` (the only way the pipeline calls a scorer) clamps them there and maps
NaN to 0, so one bad engine report cannot outweigh the other scorers. Scorers that compare workers
("load") are relative to the candidates they are given, i.e. the fleet after filtering.
Registry names: prefix, load, kv_usage, completion.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from router.placement.registry import Registry
from router.placement.types import RoutingContext, WorkerState


class Scorer(Protocol):
    name: ClassVar[str]

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Sequence[float]: ...


SCORERS: Registry[Scorer] = Registry("scorer")


def clamp01(value: float) -> float:
    return 0.0 if math.isnan(value) else min(max(value, 0.0), 1.0)


def run_scorer(scorer: Scorer, ctx: RoutingContext, workers: Sequence[WorkerState]) -> list[float]:
    """Scores clamped to [0, 1]; raises ValueError if the scorer broke the one-per-worker contract."""
    raw = list(scorer(ctx, workers))
    if len(raw) != len(workers):
        raise ValueError(f"scorer {scorer.name!r} returned {len(raw)} scores for {len(workers)} workers")
    return [clamp01(v) for v in raw]


@SCORERS.register("prefix")
@dataclass(frozen=True)
class PrefixScorer(Scorer):
    """Fraction of the prompt's full blocks the worker holds as a chain from block 0
    (`ctx.cached_blocks`, read from a PrefixIndex when the context was built)."""

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> list[float]:
        return [ctx.prefix_fraction(w.info) for w in workers]


@SCORERS.register("load")
@dataclass(frozen=True)
class LoadScorer(Scorer):
    """`1 - L_w / (max_v L_v + headroom)` with L = `WorkerState.active_requests`.

    Relative to the fleet's busiest candidate, so the scale of the counts does not matter (engine
    counts, or per-replica counters that shrink as router replicas are added). `headroom` (in
    requests) keeps small absolute gaps at low concurrency (1 vs 0) from looking like 100% vs 0%.
    An idle fleet scores 1 everywhere.
    """

    headroom: float = 4.0

    def __post_init__(self) -> None:
        if self.headroom <= 0:
            raise ValueError("load headroom must be > 0")

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> list[float]:
        loads = [w.active_requests for w in workers]
        scale = max(loads, default=0) + self.headroom
        return [1.0 - load / scale for load in loads]


@SCORERS.register("kv_usage")
@dataclass(frozen=True)
class KVUsageScorer(Scorer):
    """`1 - cache_usage` from the engine's report. A worker without a report gets the mean of the
    others (neutral: it neither wins nor loses on a number we do not have); 1.0 if nobody reports."""

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> list[float]:
        known = [clamp01(1.0 - w.load.cache_usage) for w in workers if w.load is not None]
        neutral = sum(known) / len(known) if known else 1.0
        return [neutral if w.load is None else 1.0 - w.load.cache_usage for w in workers]


def expected_completion_s(ctx: RoutingContext, worker: WorkerState, own_weight: float = 1.0,
                          default_tokens_per_s: float = 20000.0,
                          recompute_tokens_per_s: float | None = None) -> float:
    """Seconds until this request's prefill would finish on `worker`: the prefill work already
    queued there plus the request's own uncached tokens and KV pool loads (`RoutingContext.work_tokens`)
    at the worker's speed, plus a surcharge of `own_weight - 1` times the uncached tokens.

    `own_weight > 1` charges recomputation extra, as it also costs every later request its cache; a pool
    load is not surcharged, as the pool keeps the block. The surcharge is priced at
    `recompute_tokens_per_s` (the fleet's speed), not at this worker's own (the default when None): a worker
    20 % slower than its peers must not look 20 % x own_weight worse for the same recomputation, or a fleet
    of mixed speeds queues long prompts on its fastest workers while the others idle."""
    speed = worker.tokens_per_s if worker.tokens_per_s > 0 else default_tokens_per_s
    surcharge = (own_weight - 1.0) * ctx.uncached_tokens(worker.info) / (recompute_tokens_per_s or speed)
    return max(worker.backlog_s, 0.0) + ctx.work_tokens(worker.info) / speed + surcharge


def fleet_tokens_per_s(workers: Sequence[WorkerState], default_tokens_per_s: float) -> float:
    """The candidates' mean calibrated prefill speed (`default_tokens_per_s` for those not yet calibrated)."""
    if not workers:
        return default_tokens_per_s
    return sum(w.tokens_per_s if w.tokens_per_s > 0 else default_tokens_per_s for w in workers) / len(workers)


def busy_share(workers: Sequence[WorkerState]) -> float:
    """Share of the candidates with prefill work queued (0.0 for none): how much of the fleet a
    recomputed token would take from requests that are waiting."""
    return sum(w.backlog_s > 0 for w in workers) / len(workers) if workers else 0.0


def recompute_weight(own_weight: float, idle_own_weight: float | None, workers: Sequence[WorkerState]) -> float:
    """The price of a recomputed token: `own_weight` on a busy fleet, falling linearly with the busy
    share to `idle_own_weight` on an idle one (None: always `own_weight`). On an idle fleet another
    worker's spare time is free, and waiting behind a prefix holder's queue only adds latency."""
    if idle_own_weight is None:
        return own_weight
    return idle_own_weight + (own_weight - idle_own_weight) * busy_share(workers)


@SCORERS.register("completion")
@dataclass(frozen=True)
class CompletionScorer(Scorer):
    """`(best + floor_s) / (cost_w + floor_s)` with cost = `expected_completion_s`: 1.0 for the
    worker that would answer first, falling as a worker's expected completion time grows.

    Requests differ ~100x in prefill work, so this prices load in seconds of queued work instead
    of requests, and the prefix cache by the work it saves, in one unit. `floor_s` keeps gaps of a
    few milliseconds between idle workers from looking like large ratios. A recomputed token costs
    `recompute_weight(own_weight, idle_own_weight, workers)`: its own time at the worker's speed, the
    surcharge beyond it at the candidates' mean speed (`fleet_tokens_per_s`).
    """

    own_weight: float = 1.0
    floor_s: float = 0.01
    default_tokens_per_s: float = 20000.0
    idle_own_weight: float | None = None

    def __post_init__(self) -> None:
        if self.own_weight <= 0 or self.floor_s <= 0 or self.default_tokens_per_s <= 0:
            raise ValueError("completion needs own_weight, floor_s and default_tokens_per_s > 0")
        if self.idle_own_weight is not None and not 0 < self.idle_own_weight <= self.own_weight:
            raise ValueError("completion needs 0 < idle_own_weight <= own_weight")

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> list[float]:
        weight = recompute_weight(self.own_weight, self.idle_own_weight, workers)
        fleet = fleet_tokens_per_s(workers, self.default_tokens_per_s)
        costs = [expected_completion_s(ctx, w, weight, self.default_tokens_per_s, fleet) for w in workers]
        best = min(costs, default=0.0)
        return [(best + self.floor_s) / (c + self.floor_s) for c in costs]
