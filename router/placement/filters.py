"""Filters: pure `(ctx, workers) -> workers` functions that drop candidates that must not be picked.

Each keeps the input order and never adds a worker. The pipeline runs them in sequence and reports
which one emptied the set. Registry names: role, model, healthy, circuit-not-open, not-draining,
not-stuck, not-overloaded, not-backlogged.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from router.placement.registry import Registry
from router.placement.scorers import expected_completion_s
from router.placement.types import CircuitState, RoutingContext, WorkerState

Workers = tuple[WorkerState, ...]


class Filter(Protocol):
    name: ClassVar[str]

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers: ...


FILTERS: Registry[Filter] = Registry("filter")

# Which worker roles can serve a wanted role: a colocated ("both") worker can do either leg, and
# a request that wants one worker for everything needs a colocated one.
SERVES: dict[str, frozenset[str]] = {
    "prefill": frozenset({"prefill", "both"}),
    "decode": frozenset({"decode", "both"}),
    "both": frozenset({"both"}),
}


@FILTERS.register("role")
@dataclass(frozen=True)
class RoleFilter(Filter):
    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if w.info.role in SERVES[ctx.role])


@FILTERS.register("model")
@dataclass(frozen=True)
class ModelFilter(Filter):
    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if w.info.model_id == ctx.model)


@FILTERS.register("healthy")
@dataclass(frozen=True)
class HealthyFilter(Filter):
    """Drops workers whose active health checks fail, but never the last ones: a probe can time out
    on a worker that is merely busy (2 s, two misses under CPU load), and trying the least-bad worker
    beats a certain 503. Workers that really fail requests are excluded by their open circuit."""

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if w.healthy) or tuple(workers)


@FILTERS.register("circuit-not-open")
@dataclass(frozen=True)
class CircuitFilter(Filter):
    """Drops open circuits. A half-open circuit admits one probe at a time: it passes only while
    this router has nothing in flight to it, so a recovering worker is not flooded."""

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if w.circuit is CircuitState.CLOSED
                     or (w.circuit is CircuitState.HALF_OPEN and w.inflight == 0))


@FILTERS.register("not-draining")
@dataclass(frozen=True)
class DrainingFilter(Filter):
    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if not w.is_draining)


@FILTERS.register("not-stuck")
@dataclass(frozen=True)
class StuckFilter(Filter):
    """Drops a worker whose engine has been inside one command or step for more than `after_s` (its own
    report, `LoadReport.engine_busy_s`): its heartbeats go on, so it stays registered, but a new request
    would wait behind whatever holds it. Never drops the last ones: if every engine is stuck, queueing
    on one beats a certain 503."""

    after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.after_s <= 0:
            raise ValueError("not-stuck needs after_s > 0")

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        return tuple(w for w in workers if w.load is None or w.load.engine_busy_s <= self.after_s) or tuple(workers)


@FILTERS.register("not-overloaded")
@dataclass(frozen=True)
class OverloadFilter(Filter):
    """The "death spiral" guard of cache-aware routing: drops a worker whose active requests exceed
    the least-loaded candidate's by more than `abs_margin` AND by a factor above `rel_factor`
    (SGLang's imbalance rule, applied per worker). The least-loaded worker always survives, so
    this filter never empties the set; a full prefix hit cannot pull traffic onto a hot worker.

    `unseen_only`: count only requests this router replica did not send (the engine's report minus
    our in-flight), for pipelines that price their own requests by work (`not-backlogged`,
    `completion`): those see a queue of small hits for what it is, while load from other replicas
    or clients, which no ledger of ours holds, is still guarded against."""

    abs_margin: int = 8
    rel_factor: float = 1.5
    unseen_only: bool = False

    def __post_init__(self) -> None:
        if self.abs_margin < 0 or self.rel_factor < 1.0:
            raise ValueError("not-overloaded needs abs_margin >= 0 and rel_factor >= 1")

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        if not workers:
            return ()
        loads = [self._load(w) for w in workers]
        floor = min(loads)
        return tuple(w for w, load in zip(workers, loads, strict=False) if not self._overloaded(load, floor))

    def _load(self, w: WorkerState) -> int:
        return max(w.active_requests - w.inflight, 0) if self.unseen_only else w.active_requests

    def _overloaded(self, load: int, floor: int) -> bool:
        return load - floor > self.abs_margin and load > self.rel_factor * floor


@FILTERS.register("not-backlogged")
@dataclass(frozen=True)
class BacklogFilter(Filter):
    """Drops a worker whose queued prefill work (`WorkerState.backlog_s`, seconds) exceeds the
    least-backlogged candidate's by more than the slack: a prefix hit is worth waiting for, but
    not without bound, and a queue in seconds sees 100x differences in prompt size that a count
    of requests does not. The least-backlogged worker always survives.

    `with_request`: compare the request's expected completion instead (queued work plus its own
    uncached tokens there, `expected_completion_s`), so the bound is on what the client waits: a
    holder of the prefix may be further behind by the compute its hit saves.

    The slack is `tail_share` x `ctx.tail_prefill_s` (how long the fleet's long prefills recently took)
    when both are known, else `slack_s`. A fixed number of seconds fits one fleet's speed and traffic:
    on the replayed Mooncake traces the 4 s that kept conversation prefixes together let a nearly cached
    request of the synthetic trace wait 5 s behind its holder's 16 s prompt, over the oracle's whole p99
    (benchmarks/results/placement_replay_latest.md)."""

    slack_s: float = 4.0
    with_request: bool = False
    tail_share: float | None = None

    def __post_init__(self) -> None:
        if self.slack_s < 0 or (self.tail_share is not None and self.tail_share < 0):
            raise ValueError("not-backlogged needs slack_s >= 0 and tail_share >= 0")

    def slack(self, ctx: RoutingContext) -> float:
        tail = ctx.tail_prefill_s
        return self.slack_s if self.tail_share is None or tail is None else self.tail_share * tail

    def __call__(self, ctx: RoutingContext, workers: Sequence[WorkerState]) -> Workers:
        if not workers:
            return ()
        costs = [expected_completion_s(ctx, w) if self.with_request else w.backlog_s for w in workers]
        floor, slack = min(costs), self.slack(ctx)
        return tuple(w for w, cost in zip(workers, costs, strict=True) if cost - floor <= slack)
