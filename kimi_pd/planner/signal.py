"""The autoscaler's signal: how many workers each pool should have now, from the load the workers
report to the store, damped, as Prometheus gauges an HPA (external metrics) or KEDA reads.

The raw count per pool is target tracking, as an HPA does it: prefill wants its queued + running
prompts at most `prefill_busy_per_worker` a worker (more and TTFT queues up); decode wants its
sequences at most `decode_fill` of a worker's batch (fuller steps are slower, TPOT). Damping: a rise
is followed at once (at most `max_step_up` a decision), a fall only to the highest count asked for
in the last `down_window_s` and one worker per `down_step_s`, so a burst's tail does not flap pools.
Draining workers are not counted as capacity (they are leaving).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from shared.store.base import WorkerRecord

DESIRED_METRIC = "kimi_pd_planner_desired_workers"
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Bounds:
    minimum: int = 1
    maximum: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.minimum <= self.maximum:
            raise ValueError(f"pool bounds: need 0 <= min <= max, got {self.minimum}..{self.maximum}")

    def clamp(self, n: int) -> int:
        return max(self.minimum, min(self.maximum, n))


@dataclass(frozen=True)
class Targets:
    prefill_busy_per_worker: float = 2.0
    decode_fill: float = 0.75
    decode_batch: int = 8                     # the workers' --max-num-seqs


@dataclass(frozen=True)
class PoolLoad:
    workers: int          # serving, not draining
    busy: int             # running + waiting (+ held states, for prefill)


def pool_loads(records: Iterable[WorkerRecord]) -> dict[str, PoolLoad]:
    """Per pool, the serving workers and the work they report (a colocated worker counts as decode)."""
    workers = dict.fromkeys(POOLS, 0)
    busy = dict.fromkeys(POOLS, 0)
    for rec in records:
        pool = "prefill" if rec.info.role == "prefill" else "decode"
        busy[pool] += rec.load.running + rec.load.waiting + (rec.load.held if pool == "prefill" else 0)
        if not rec.load.draining:
            workers[pool] += 1
    return {p: PoolLoad(workers[p], busy[p]) for p in POOLS}


def raw_desired(pool: str, load: PoolLoad, targets: Targets) -> int:
    """Workers that would carry `load` at the target (never fewer than one with work to do)."""
    per_worker = targets.prefill_busy_per_worker if pool == "prefill" else targets.decode_fill * targets.decode_batch
    return math.ceil(load.busy / per_worker) if load.busy else 0


class Damper:
    """Desired counts over time for one pool, bounded and damped (see the module docstring)."""

    def __init__(self, bounds: Bounds, down_window_s: float = 60.0, down_step_s: float = 30.0,
                 max_step_up: int = 4) -> None:
        self.bounds, self.down_window_s, self.down_step_s, self.max_step_up = (bounds, down_window_s, down_step_s,
                                                                                max_step_up)
        self.asked: deque[tuple[float, int]] = deque()
        self.current: int | None = None
        self.last_down = -math.inf

    def decide(self, now: float, raw: int) -> int:
        self.asked.append((now, self.bounds.clamp(raw)))
        while self.asked and self.asked[0][0] < now - self.down_window_s:
            self.asked.popleft()
        wanted = max(n for _, n in self.asked)
        if self.current is None:
            self.current = wanted
        elif wanted > self.current:
            self.current = min(wanted, self.current + self.max_step_up)
        elif wanted < self.current and now - self.last_down >= self.down_step_s:
            self.current -= 1
            self.last_down = now
        return self.current


def render_metrics(desired: dict[str, int], loads: dict[str, PoolLoad]) -> str:
    """Prometheus text: the desired count per pool, and what it was computed from."""
    lines = [f"# HELP {DESIRED_METRIC} Workers the pool should have now (bounded, damped)",
             f"# TYPE {DESIRED_METRIC} gauge"]
    lines += [f'{DESIRED_METRIC}{{pool="{p}"}} {desired[p]}' for p in POOLS]
    lines += ["# HELP kimi_pd_planner_serving_workers Workers serving (not draining)",
              "# TYPE kimi_pd_planner_serving_workers gauge"]
    lines += [f'kimi_pd_planner_serving_workers{{pool="{p}"}} {loads[p].workers}' for p in POOLS]
    lines += ["# HELP kimi_pd_planner_busy Requests running or waiting in the pool",
              "# TYPE kimi_pd_planner_busy gauge"]
    lines += [f'kimi_pd_planner_busy{{pool="{p}"}} {loads[p].busy}' for p in POOLS]
    return "\n".join(lines) + "\n"
