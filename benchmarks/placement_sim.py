"""The simulator behind benchmarks/placement_replay.py: FIFO prefill workers with LRU prefix caches, the
baselines, and the router's real registry and placement pipeline driven on a simulated clock.

Every run serves the whole request list and reports only the scored requests: `start..` (the part
before warms the caches and the router's ledger), or a list of indices (interleaved windows, where the
other windows are served but not scored): a figure on a held-out part never includes its warm-up.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.placement.context import context_from_hashes
from router.placement.pipeline import build_pipeline
from router.placement.types import HashKey
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.workers import LoadReport

TRACE_BLOCK = 512
MODEL = "kimi-k3"


@dataclass(frozen=True)
class Request:
    arrival: float            # seconds, already scaled
    tokens: int
    blocks: tuple[int, ...]   # hash ids of the FULL blocks (engines cache full blocks only)


class LRU:
    """A worker's prefix cache: leading-hit lookup, then the prompt's blocks touched last to first
    (block 0 most recent, so a prompt's tail is evicted before its head, as engines free them)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.blocks = capacity, OrderedDict[int, None]()

    def peek(self, blocks: Sequence[int]) -> int:
        hit = 0
        for h in blocks:
            if h not in self.blocks:
                break
            hit += 1
        return hit

    def serve(self, blocks: Sequence[int]) -> int:
        hit = self.peek(blocks)
        for h in reversed(blocks):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)
        return hit


Scored = int | Sequence[int]     # the first scored request, or the scored requests' indices


def scored_indices(n: int, scored: Scored) -> Sequence[int]:
    return range(scored, n) if isinstance(scored, int) else scored


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _p99(values: Sequence[float]) -> float:
    """nearest_rank(sorted(values), 0.99) without sorting all of them."""
    k = len(values) - max(0, math.ceil(0.99 * len(values)) - 1)       # rank from the top
    return heapq.nlargest(k, values)[-1]


def tail_breakdown(fleet: Fleet, oracle: Fleet, scored: Sequence[int]) -> dict[str, float]:
    """What the requests at or above `fleet`'s p99 TTFT were doing: the share that spent most of it queued
    behind other prefills (`queued_share`), the share of those whose prompt was mostly cached where they
    queued (`queued_cached_share`: 90 % of its tokens or more a hit), and the median TTFT the oracle gave
    those queued ones. A tail of queued, cached requests is lost to where a prefix lives (one
    holder, busy), not to the compute a request needed."""
    picked = list(scored)
    p99 = _p99([fleet.ttft[i] for i in picked])
    tail = [i for i in picked if fleet.ttft[i] >= p99]
    queued = [i for i in tail if fleet.waits[i] > fleet.ttft[i] / 2]
    cached = [i for i in queued if fleet.hits[i] >= 0.9 * fleet.tokens[i]]
    oracle_ttft = sorted(oracle.ttft[i] for i in queued)
    return {"requests": len(tail), "queued_share": len(queued) / len(tail) if tail else 0.0,
            "queued_cached_share": len(cached) / len(queued) if queued else 0.0,
            "queued_oracle_ttft_p50_s": nearest_rank(oracle_ttft, 0.5) if oracle_ttft else 0.0}


def p99_ratio_interval(ttft: Sequence[float], oracle_ttft: Sequence[float], scored: Sequence[int],
                       draws: int = 200, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of p99(ttft) / p99(oracle_ttft) over the scored requests resampled with
    replacement (the same draw for both: a paired bootstrap). How far a cell's ratio moves with which
    requests happen to fall in the tail: a p99 over a few thousand requests rests on its top few dozen."""
    rng = random.Random(seed)
    picked = list(scored)
    ratios = []
    for _ in range(draws):
        sample = rng.choices(picked, k=len(picked))
        ratios.append(_p99([ttft[i] for i in sample]) / _p99([oracle_ttft[i] for i in sample]))
    ratios.sort()
    return nearest_rank(ratios, 0.05), nearest_rank(ratios, 0.95)


class Fleet:
    """FIFO prefill workers with LRU caches; what happened to every request, in arrival order.

    `speeds[w]` is worker w's true prefill speed (tokens/s); `overhead_s` a fixed cost per request
    (scheduling, one forward's launch), which the router's speed guess does not know about. With
    `pool_capacity`, the workers also share a KV pool of that many blocks: a prompt's blocks are saved there
    when its prefill finishes, and a worker loads the pool's chain beyond its own cached prefix (as the pool
    holds it when the request arrives) at `pool_load_cost` of what computing it costs. The router adds a
    prompt to its view of the pool when it sees the prefill answered (`reply_delay_s` after it ends)."""

    def __init__(self, speeds: Sequence[float], cache_blocks: int | None, shared_cache: bool = False,
                 overhead_s: float = 0.0, shared_blocks: int | None = None, pool_capacity: int | None = None,
                 pool_load_cost: float = 0.1) -> None:
        shared = LRU(shared_blocks) if shared_cache else None
        self.caches = [shared or LRU(cache_blocks) for _ in speeds]
        self.pool = LRU(pool_capacity) if pool_capacity else None
        self.pool_load_cost = pool_load_cost
        self._saving: list[tuple[float, int, tuple[int, ...]]] = []   # (prefill end, seq, blocks) not yet pooled
        self._seq = itertools.count()
        self.speeds, self.overhead_s = list(speeds), overhead_s
        self.free_at = [0.0] * len(speeds)
        self.ends: list[list[float]] = [[] for _ in speeds]   # finish times, for heartbeats/least loaded
        self.ttft: list[float] = []
        self.waits: list[float] = []                  # queued before its prefill started
        self.hits: list[int] = []
        self.tokens: list[int] = []

    def service_s(self, worker: int, req: Request, hit_blocks: int, loaded_blocks: int = 0) -> float:
        uncached = max(req.tokens - min(hit_blocks * TRACE_BLOCK, req.tokens), 1)
        loaded = self.pool_load_cost * loaded_blocks * TRACE_BLOCK
        return self.overhead_s + (uncached + loaded) / self.speeds[worker]

    def pooled(self, req: Request) -> int:
        """Leading blocks of `req` in the pool when it arrives: what prefills finished by then saved."""
        if self.pool is None:
            return 0
        saving = self._saving
        while saving and saving[0][0] <= req.arrival:
            self.pool.serve(heapq.heappop(saving)[2])
        return self.pool.peek(req.blocks)

    def serve(self, worker: int, req: Request) -> float:
        """Queue `req` on `worker`; returns its finish time."""
        pooled = self.pooled(req)
        local = self.caches[worker].serve(req.blocks)
        hit_blocks = max(local, pooled)
        start = max(req.arrival, self.free_at[worker])
        self.free_at[worker] = end = start + self.service_s(worker, req, hit_blocks, hit_blocks - local)
        if self.pool is not None:
            heapq.heappush(self._saving, (end, next(self._seq), req.blocks))
        self.ends[worker].append(end)
        self.ttft.append(end - req.arrival)
        self.waits.append(start - req.arrival)
        self.hits.append(min(hit_blocks * TRACE_BLOCK, req.tokens))
        self.tokens.append(req.tokens)
        return end

    def unfinished(self, worker: int, at: float) -> int:
        """Requests queued or running on `worker` at time `at` (FIFO: finish times are sorted)."""
        ends = self.ends[worker]
        lo, hi = 0, len(ends)
        while lo < hi:
            mid = (lo + hi) // 2
            if ends[mid] <= at:
                lo = mid + 1
            else:
                hi = mid
        return len(ends) - lo

    def result(self, scored: Scored = 0) -> dict[str, float]:
        """Hit ratio and TTFT percentiles over the scored requests only."""
        picked = scored_indices(len(self.ttft), scored)
        ordered = sorted(self.ttft[i] for i in picked)
        return {"hit_ratio": sum(self.hits[i] for i in picked) / sum(self.tokens[i] for i in picked),
                "ttft_p50_s": nearest_rank(ordered, 0.50), "ttft_p90_s": nearest_rank(ordered, 0.90),
                "ttft_p99_s": nearest_rank(ordered, 0.99), "ttft_mean_s": statistics.fmean(ordered)}


def true_speeds(n: int, args: argparse.Namespace) -> list[float]:
    """Each worker's true speed: `tokens_per_s`, spread evenly over +-`speed_spread` (0: all equal)."""
    spread = getattr(args, "speed_spread", 0.0)
    if n == 1 or spread == 0:
        return [args.tokens_per_s] * n
    return [args.tokens_per_s * (1 - spread + 2 * spread * w / (n - 1)) for w in range(n)]


def pool_blocks(n: int, args: argparse.Namespace, told: bool = False) -> int:
    """The KV pool's blocks: `kv_pool` times the fleet's cache blocks (0: no pool); `told`: the size the
    router is given, `kv_pool_told` times them when set (a misconfigured router)."""
    told_share = getattr(args, "kv_pool_told", None) if told else None
    share = getattr(args, "kv_pool", 0.0) if told_share is None else told_share
    return round(share * n * args.cache_blocks)


def new_fleet(n: int, args: argparse.Namespace, shared_cache: bool = False, shared_blocks: int | None = None) -> Fleet:
    """Workers with their own LRUs (and the KV pool of `--kv-pool`, if any), or one cache shared by all
    (`shared_blocks`; None: infinite)."""
    pool = None if shared_cache else pool_blocks(n, args) or None
    return Fleet(true_speeds(n, args), args.cache_blocks, shared_cache, getattr(args, "overhead_s", 0.0),
                 shared_blocks, pool, getattr(args, "kv_pool_load_cost", 0.1))


# ---- baselines ------------------------------------------------------------------------------------

Chooser = Callable[[Fleet, Request, int], int]


def simple_fleet(reqs: Sequence[Request], n: int, args: argparse.Namespace, choose: Chooser,
                 shared_cache: bool = False, shared_blocks: int | None = None) -> Fleet:
    """The fleet after `choose` dispatched every request (read its figures with `Fleet.result`)."""
    fleet = new_fleet(n, args, shared_cache, shared_blocks)
    for i, req in enumerate(reqs):
        fleet.serve(choose(fleet, req, i), req)
    return fleet


def run_simple(reqs: Sequence[Request], n: int, args: argparse.Namespace, choose: Chooser,
               shared_cache: bool = False, scored: Scored = 0, shared_blocks: int | None = None) -> dict[str, float]:
    return simple_fleet(reqs, n, args, choose, shared_cache, shared_blocks).result(scored)


def round_robin(fleet: Fleet, req: Request, i: int) -> int:
    return i % len(fleet.free_at)


def least_loaded(fleet: Fleet, req: Request, i: int) -> int:
    n = len(fleet.free_at)
    return min(((i + k) % n for k in range(n)), key=lambda w: fleet.unfinished(w, req.arrival))


def earliest_free(fleet: Fleet, req: Request, i: int) -> int:
    """The oracle's dispatch: the worker that frees first (ties: the first)."""
    return min(range(len(fleet.free_at)), key=lambda w: (max(fleet.free_at[w], req.arrival), w))


def clairvoyant(own_weight: float) -> Chooser:
    """Dispatch on the true per-worker queues, caches and KV pool: the worker minimising the request's true
    finish time plus (`own_weight` - 1) x its recomputed tokens at the fleet's mean speed (the router's
    pricing, router/placement/scorers.py). own_weight 1: the request's own earliest finish (greedy); the
    router's own_weight: our cost function with perfect knowledge. What placement could get on these caches
    without look-ahead, to tell our estimates' error from the caches' limit."""
    def choose(fleet: Fleet, req: Request, i: int) -> int:
        mean_speed = sum(fleet.speeds) / len(fleet.speeds)
        pooled = fleet.pooled(req)                      # the same for every worker: read once

        def cost(w: int) -> float:
            local = fleet.caches[w].peek(req.blocks)
            hit = max(local, pooled)
            recomputed = max(req.tokens - min(hit * TRACE_BLOCK, req.tokens), 1)
            finish = max(fleet.free_at[w], req.arrival) + fleet.service_s(w, req, hit, hit - local)
            return finish + (own_weight - 1) * recomputed / mean_speed
        return min(range(len(fleet.free_at)), key=lambda w: (cost(w), w))
    return choose


def pooled_lru_hits(reqs: Sequence[Request], blocks: int) -> list[int]:
    """Tokens each request finds in one LRU of `blocks` (the fleet's caches pooled)."""
    cache = LRU(blocks)
    return [min(cache.serve(req.blocks) * TRACE_BLOCK, req.tokens) for req in reqs]


def hit_share(hits: Sequence[int], reqs: Sequence[Request], scored: Scored) -> float:
    picked = scored_indices(len(reqs), scored)
    return sum(hits[i] for i in picked) / sum(reqs[i].tokens for i in picked)


def pooled_lru_hit(reqs: Sequence[Request], blocks: int, scored: Scored = 0) -> float:
    return hit_share(pooled_lru_hits(reqs, blocks), reqs, scored)


# ---- the router -----------------------------------------------------------------------------------

class _RouterSim:
    """The router's registry and pipeline against a simulated fleet; events settle in time order."""

    def __init__(self, n: int, args: argparse.Namespace, settings: RouterSettings) -> None:
        self.clock = [0.0]
        self.registry = WorkerRegistry(settings, None, clock=lambda: self.clock[0])
        self.pipeline = build_pipeline(**settings.pipeline_spec())
        self.urls = list(settings.static_prefill)
        self.key = HashKey.of(self.registry.static[self.urls[0]])
        self.fleet = new_fleet(n, args)
        self.args = args
        self.events: list[tuple[float, int, str, Any]] = []       # (time, seq, kind, payload)
        self.seq = itertools.count()
        self.next_beat = args.heartbeat_s

    def beat(self) -> None:
        """A heartbeat is sampled on every worker; the router sees it `report_delay_s` later."""
        at, args = self.next_beat, self.args
        for w, url in enumerate(self.urls):
            report = LoadReport(running=self.fleet.unfinished(w, at), ts=at,
                                capacity_tokens=args.cache_blocks * TRACE_BLOCK)
            heapq.heappush(self.events, (at + args.report_delay_s, next(self.seq), "report", (url, report)))
        self.next_beat += args.heartbeat_s

    def advance(self, to: float) -> None:
        while True:
            beat_due = self.next_beat if self.next_beat <= to and (self.events or to < math.inf) else math.inf
            event_due = self.events[0][0] if self.events and self.events[0][0] <= to else math.inf
            if beat_due is math.inf and event_due is math.inf:
                break
            if beat_due < event_due:
                self.beat()
                continue
            at, _, kind, payload = heapq.heappop(self.events)
            self.clock[0] = at
            if kind == "reply":                            # the prefill answer: settle the leg, end the call
                url, leg = payload
                self.registry.settle_leg(leg)                 # a pool member's prompt joins the pool now
                self.registry.end(url, ok=True)
            else:
                url, report = payload
                self.registry.loads[url] = report
        self.clock[0] = to

    def place(self, i: int, req: Request) -> None:
        self.advance(req.arrival)
        registry = self.registry
        states = registry.states()
        ctx = context_from_hashes(f"r{i}", req.tokens, {self.key: req.blocks}, states, registry.index,
                                  model=MODEL, role="prefill", now=req.arrival,
                                  tail_prefill_s=registry.ledger.tail_prefill_s(), pool=registry.pool)
        chosen = self.pipeline.pick(ctx, states).worker
        url = chosen.worker_id
        registry.begin(url)
        leg = registry.open_leg(chosen.info, ctx.work_tokens(chosen.info), ctx.hashes_for(chosen.info))
        registry.index.record_sent(url, ctx.hashes_for(chosen.info))
        end = self.fleet.serve(self.urls.index(url), req)
        seen = end + getattr(self.args, "reply_delay_s", 0.0)
        heapq.heappush(self.events, (seen, next(self.seq), "reply", (url, leg)))


def router_fleet(reqs: Sequence[Request], n: int, args: argparse.Namespace,
                 settings: RouterSettings) -> tuple[Fleet, list[int]]:
    """The fleet after the router's registry and pipeline placed every request on a simulated clock, and
    the prefill speeds the router's ledger had calibrated by the end."""
    sim = _RouterSim(n, args, settings)
    for i, req in enumerate(reqs):
        sim.place(i, req)
    sim.advance(math.inf)
    return sim.fleet, [round(sim.registry.ledger.tokens_per_s(u)) for u in sim.urls]


def run_router(reqs: Sequence[Request], n: int, args: argparse.Namespace, settings: RouterSettings,
               scored: Scored = 0) -> dict[str, Any]:
    """`router_fleet`'s figures over the scored requests only."""
    fleet, speeds = router_fleet(reqs, n, args, settings)
    return {**fleet.result(scored), "calibrated_tokens_per_s": speeds}
