"""The search: the cheapest prefill/decode split (and colocated size) whose simulation meets the SLO.

Pools are searched one at a time, each by doubling then bisection on the count (more workers of a
pool never make its own latency worse): first a fleet large enough in both pools, then the fewest
prefill workers that keep TTFT with that many decode workers, then the fewest decode workers with
those prefill workers, then one neighbour each way, since the pools interact a little (a bigger
decode pool admits transferred requests sooner). Every candidate is one simulation of the trace.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kimi_pd.planner.costs import CostModel
from kimi_pd.planner.simulate import Fleet, simulate
from kimi_pd.planner.workload import Request, span_s

DEFAULT_THRESHOLDS = (0, 256, 1024, 4096)


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None leaves a percentile free."""

    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p99_s: float | None = None

    def misses(self, result: dict[str, Any]) -> list[str]:
        """The targets `result` misses (a nan percentile, no requests of that kind, meets it)."""
        out = []
        for name, limit in asdict(self).items():
            got = result.get(name)
            if limit is not None and got is not None and not math.isnan(got) and got > limit:
                out.append(f"{name} {got:.3f} > {limit}")
        return out

    def met(self, result: dict[str, Any]) -> bool:
        return not self.misses(result)


def smallest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest n in [lo, hi] with ok(n), for ok monotone (false then true): doubling from lo,
    then bisection. None when even hi fails. ok is called O(log hi) times."""
    if lo > hi:
        return None
    n, last_bad = lo, lo - 1
    while not ok(n):
        if n >= hi:
            return None
        last_bad, n = n, min(hi, max(n * 2, n + 1))
    while n - last_bad > 1:
        mid = (n + last_bad) // 2
        if ok(mid):
            n = mid
        else:
            last_bad = mid
    return n


def lower_bounds(reqs: Sequence[Request], costs: CostModel) -> tuple[int, int]:
    """Workers each pool needs just to keep up on average (every prompt token uncached for prefill;
    decode at full batches): where the search starts."""
    span = span_s(reqs)
    prefill_s = sum(costs.prefill_s(r.input_tokens, r.input_tokens) for r in reqs)
    full = costs.max_batch
    decode_s = sum(r.output_tokens for r in reqs) * costs.decode_step(full) / full
    return max(1, math.floor(prefill_s / span)), max(1, math.floor(decode_s / span))


class Search:
    """Simulations of one workload, cached by fleet."""

    def __init__(self, reqs: Sequence[Request], costs: CostModel, slo: SLO, max_workers: int, seed: int = 0,
                 simulate_fn: Callable[..., dict[str, Any]] = simulate) -> None:
        self.reqs, self.costs, self.slo, self.max_workers, self.seed = reqs, costs, slo, max_workers, seed
        self.simulate_fn = simulate_fn
        self.runs: dict[Fleet, dict[str, Any]] = {}

    def run(self, fleet: Fleet) -> dict[str, Any]:
        if fleet not in self.runs:
            self.runs[fleet] = self.simulate_fn(self.reqs, fleet, self.costs, seed=self.seed)
        return self.runs[fleet]

    def ok(self, fleet: Fleet) -> bool:
        return self.slo.met(self.run(fleet))

    def cost(self, fleet: Fleet) -> float:
        if fleet.colocated:
            return self.costs.cost("colocated", fleet.decode)
        return self.costs.cost("prefill", fleet.prefill) + self.costs.cost("decode", fleet.decode)

    def colocated(self) -> Fleet | None:
        lo = max(1, sum(lower_bounds(self.reqs, self.costs)) // 2)
        n = smallest(lambda k: self.ok(Fleet(0, k)), lo, self.max_workers)
        return None if n is None else Fleet(0, n)

    def disaggregated(self, threshold: int) -> Fleet | None:
        p_lo, d_lo = lower_bounds(self.reqs, self.costs)
        big = smallest(lambda k: self.ok(Fleet(k * p_lo, k * d_lo, threshold)), 1,
                       max(1, self.max_workers // max(p_lo, d_lo)))
        if big is None:
            return None
        p_big, d_big = big * p_lo, big * d_lo
        p = smallest(lambda k: self.ok(Fleet(k, d_big, threshold)), 1, p_big) or p_big
        d = smallest(lambda k: self.ok(Fleet(p, k, threshold)), 1, d_big) or d_big
        best = Fleet(p, d, threshold)
        for dp in (-1, 1):
            q = p + dp
            if q < 1:
                continue
            e = self._fewest_decode(q, d_big, threshold)
            if e is not None and self.cost(Fleet(q, e, threshold)) < self.cost(best):
                best = Fleet(q, e, threshold)
        return best

    def _fewest_decode(self, prefill: int, most: int, threshold: int) -> int | None:
        return smallest(lambda k: self.ok(Fleet(prefill, k, threshold)), 1, most)

    def cheapest(self, fleets: Sequence[Fleet | None]) -> Fleet | None:
        """Least cost; ties go to the lower p99 TTFT, then the fewer decode-only requests."""
        found = [f for f in fleets if f is not None]
        if not found:
            return None
        return min(found, key=lambda f: (self.cost(f), self.run(f)["ttft_p99_s"], f.threshold))


def plan(reqs: Sequence[Request], costs: CostModel, slo: SLO, max_workers: int = 64,
         thresholds: Sequence[int] = DEFAULT_THRESHOLDS, seed: int = 0) -> dict[str, Any]:
    """The planner's answer: the cheapest P/D fleet (and its decode-only threshold), the cheapest
    colocated fleet, which of the two to run, and every simulation it took."""
    search = Search(reqs, costs, slo, max_workers, seed)
    by_threshold = {t: search.disaggregated(t) for t in thresholds}
    pd = search.cheapest(list(by_threshold.values()))
    colo, colo_search = best_colocated(reqs, costs, slo, max_workers, seed)
    answer = verdict(describe(pd, search), describe(colo, colo_search))
    return {"slo": asdict(slo), "max_workers": max_workers, "answer": answer,
            "disaggregated": describe(pd, search), "colocated": describe(colo, colo_search),
            "by_threshold": {str(t): describe(f, search) for t, f in by_threshold.items()},
            "simulations": len(search.runs) + len(colo_search.runs)}


def chunk_options(costs: CostModel) -> tuple[int, ...]:
    """Chunked-prefill budgets a colocated fleet is given the benefit of: smaller chunks lengthen a
    decode step less (TPOT) but stretch the prefill over more steps (TTFT)."""
    return tuple(sorted({costs.chunk_tokens, max(256, costs.chunk_tokens // 4)}, reverse=True))


def best_colocated(reqs: Sequence[Request], costs: CostModel, slo: SLO, max_workers: int,
                   seed: int) -> tuple[Fleet | None, Search]:
    """The cheapest colocated fleet over the chunk budgets, and the search (its costs) that found it.
    Budgets under 256 tokens a step are not tried: they stretch long prompts over so many steps that
    TTFT is lost (1/16 of 2k tokens took 130 s p99 TTFT on the conversation trace)."""
    found = []
    for chunk in chunk_options(costs):
        search = Search(reqs, replace(costs, chunk_tokens=chunk), slo, max_workers, seed)
        fleet = search.colocated()
        found.append((math.inf if fleet is None else search.cost(fleet), -chunk, fleet, search))
    _, _, fleet, search = min(found, key=lambda f: (f[0], f[1]))
    return fleet, search


def verdict(pd: dict[str, Any] | None, colo: dict[str, Any] | None) -> str:
    """Disaggregated when it costs less; at equal cost, whichever has the lower p99 TTFT."""
    if pd is None and colo is None:
        return "infeasible"
    if colo is None or (pd is not None and pd["cost"] < colo["cost"]):
        return "disaggregated"
    if pd is None or colo["cost"] < pd["cost"]:
        return "colocated"
    return "disaggregated" if pd["ttft_p99_s"] <= colo["ttft_p99_s"] else "colocated"


def describe(fleet: Fleet | None, search: Search) -> dict[str, Any] | None:
    if fleet is None:
        return None
    result = search.run(fleet)
    own = {k: v for k, v in result.items() if k not in ("prefill", "decode", "threshold")}
    return {"prefill": fleet.prefill, "decode": fleet.decode, "threshold": fleet.threshold,
            "cost": search.cost(fleet), "chunk_tokens": search.costs.chunk_tokens, **own}
