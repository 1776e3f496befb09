"""Replay the Mooncake traces through the router's own placement against simulated prefill workers.

Run: `python -m benchmarks.placement_replay [--traces conversation synthetic] [--workers 4 8]
[--loads 0.8 1.2] [--cache-blocks 8192] [--tokens-per-s 12000] [--limit N]`.

What is real: the router's `WorkerRegistry` (static workers, approximate prefix index sized from
the workers' cache capacity, the work ledger, heartbeat correction), `RouterSettings` defaults, and
the placement `Pipeline` the router builds from them; a simulated clock drives them. What is
simulated: each worker is a FIFO server with a finite LRU prefix cache of `--cache-blocks` blocks
(one block = one 512-token trace `hash_id`); a request's service time is its uncached tokens /
`--tokens-per-s`; workers publish running + waiting every `--heartbeat-s` (the router reads each
report `--report-delay-s` later, as through the store); a prefill reply settles its ledger leg.
The router starts from its default speed guess (`prefill_tokens_per_s`), not the true one.

Arrivals keep the trace's order and bursts, with time scaled so that the offered prompt tokens are
`load` x the fleet's capacity (workers x tokens/s, counting every prompt token as uncached).

Baselines in the same run, on the same simulated workers: round robin, least loaded (fewest
unfinished requests, exact), ours with the index at the old fixed 65,536 blocks, the router's
previous default (prefix + request-count load + kv usage,
a fixed 65,536-block index), and an oracle: one shared infinite cache and dispatch to the worker
that frees first (exact). `pooled_lru_hit` is the hit ratio of one LRU of workers x cache-blocks.
Goal: hit >= 0.97 x pooled LRU and p99 TTFT <= 1.1 x the oracle's. JSON to
benchmarks/results/placement_replay.json.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from router.placement.context import context_from_hashes
from router.placement.pipeline import build_pipeline
from router.placement.types import HashKey
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.workers import LoadReport

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "placement_replay.json"
TRACES = Path("/work/shared/data/mooncake")
TRACE_BLOCK = 512
MODEL = "kimi-k3"
LEGACY_WEIGHTS = (("prefix", 1.0), ("load", 1.0), ("kv_usage", 0.5))
LEGACY_FILTERS = ("model", "role", "healthy", "circuit-not-open", "not-draining", "not-overloaded")
GOAL_HIT, GOAL_P99 = 0.97, 1.1


@dataclass(frozen=True)
class Request:
    arrival: float            # seconds, already scaled
    tokens: int
    blocks: tuple[int, ...]   # hash ids of the FULL blocks (engines cache full blocks only)


def load_trace(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for line in itertools.islice(f, limit):
            rows.append(json.loads(line))
    return rows


def scaled(rows: Sequence[dict[str, Any]], load: float, capacity_tokens_per_s: float) -> list[Request]:
    """Arrivals scaled so the offered prompt tokens per second are `load` x capacity."""
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 or 1.0
    offered = sum(r["input_length"] for r in rows) / span
    factor = offered / (load * capacity_tokens_per_s)
    t0 = rows[0]["timestamp"]
    return [Request((r["timestamp"] - t0) / 1000 * factor, r["input_length"],
                    tuple(r["hash_ids"][:r["input_length"] // TRACE_BLOCK])) for r in rows]


class LRU:
    """A worker's prefix cache: leading-hit lookup, then the prompt's blocks touched last to first
    (block 0 most recent, so a prompt's tail is evicted before its head, as engines free them)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def serve(self, blocks: Sequence[int]) -> int:
        hit = 0
        for h in blocks:
            if h not in self.blocks:
                break
            hit += 1
        for h in reversed(blocks):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)
        return hit


class Fleet:
    """FIFO prefill workers with LRU caches; what happened to every request."""

    def __init__(self, n: int, cache_blocks: int | None, tokens_per_s: float, shared_cache: bool = False) -> None:
        shared = LRU(None) if shared_cache else None
        self.caches = [shared or LRU(cache_blocks) for _ in range(n)]
        self.free_at = [0.0] * n
        self.ends: list[list[float]] = [[] for _ in range(n)]   # finish times, for heartbeats/least loaded
        self.tokens_per_s = tokens_per_s
        self.ttft: list[float] = []
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def serve(self, worker: int, req: Request) -> float:
        """Queue `req` on `worker`; returns its finish time."""
        hit_tokens = min(self.caches[worker].serve(req.blocks) * TRACE_BLOCK, req.tokens)
        uncached = max(req.tokens - hit_tokens, 1)
        start = max(req.arrival, self.free_at[worker])
        self.free_at[worker] = end = start + uncached / self.tokens_per_s
        self.ends[worker].append(end)
        self.ttft.append(end - req.arrival)
        self.hit_tokens += hit_tokens
        self.prompt_tokens += req.tokens
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

    def result(self) -> dict[str, float]:
        ordered = sorted(self.ttft)
        pick = lambda q: ordered[max(0, math.ceil(q * len(ordered)) - 1)]   # noqa: E731 - nearest rank
        return {"hit_ratio": self.hit_tokens / self.prompt_tokens, "ttft_p50_s": pick(0.50),
                "ttft_p99_s": pick(0.99), "ttft_mean_s": statistics.fmean(ordered)}


# ---- policies -------------------------------------------------------------------------------------

def run_simple(reqs: Sequence[Request], n: int, args: argparse.Namespace, choose: Callable[[Fleet, Request, int], int],
               shared_cache: bool = False) -> dict[str, float]:
    fleet = Fleet(n, args.cache_blocks, args.tokens_per_s, shared_cache)
    for i, req in enumerate(reqs):
        fleet.serve(choose(fleet, req, i), req)
    return fleet.result()


def round_robin(fleet: Fleet, req: Request, i: int) -> int:
    return i % len(fleet.free_at)


def least_loaded(fleet: Fleet, req: Request, i: int) -> int:
    n = len(fleet.free_at)
    return min(((i + k) % n for k in range(n)), key=lambda w: fleet.unfinished(w, req.arrival))


def earliest_free(fleet: Fleet, req: Request, i: int) -> int:
    return min(range(len(fleet.free_at)), key=lambda w: (max(fleet.free_at[w], req.arrival), w))


def run_router(reqs: Sequence[Request], n: int, args: argparse.Namespace, settings: RouterSettings) -> dict[str, Any]:
    """The router's registry and pipeline against the simulated fleet, on a simulated clock."""
    clock = [0.0]
    registry = WorkerRegistry(settings, None, clock=lambda: clock[0])
    pipeline = build_pipeline(**settings.pipeline_spec())
    urls = list(settings.static_prefill)
    key = HashKey.of(registry.static[urls[0]])
    fleet = Fleet(n, args.cache_blocks, args.tokens_per_s)
    events: list[tuple[float, int, str, Any]] = []       # (time, seq, kind, payload), settled in time order
    seq = itertools.count()
    next_beat = args.heartbeat_s

    def advance(to: float) -> None:
        nonlocal next_beat
        while True:
            beat_due = next_beat if next_beat <= to and (events or to < math.inf) else math.inf
            event_due = events[0][0] if events and events[0][0] <= to else math.inf
            if beat_due is math.inf and event_due is math.inf:
                break
            if beat_due < event_due:                      # a heartbeat is sampled; the router sees it later
                for w, url in enumerate(urls):
                    report = LoadReport(running=fleet.unfinished(w, next_beat), ts=next_beat,
                                        capacity_tokens=args.cache_blocks * TRACE_BLOCK)
                    heapq.heappush(events, (next_beat + args.report_delay_s, next(seq), "report", (url, report)))
                next_beat += args.heartbeat_s
                continue
            at, _, kind, payload = heapq.heappop(events)
            clock[0] = at
            if kind == "reply":                            # the prefill answer: settle the leg, end the call
                url, leg = payload
                registry.ledger.settle(leg)
                registry.end(url, ok=True)
            else:
                url, report = payload
                registry.loads[url] = report
        clock[0] = to

    for i, req in enumerate(reqs):
        advance(req.arrival)
        states = registry.states()
        ctx = context_from_hashes(f"r{i}", req.tokens, {key: req.blocks}, states, registry.index,
                                  model=MODEL, role="prefill", now=req.arrival)
        chosen = pipeline.pick(ctx, states).worker
        url = chosen.worker_id
        registry.begin(url)
        leg = registry.ledger.open(url, ctx.uncached_tokens(chosen.info))
        registry.index.record_sent(url, ctx.hashes_for(chosen.info))
        end = fleet.serve(urls.index(url), req)
        heapq.heappush(events, (end, next(seq), "reply", (url, leg)))
    advance(math.inf)
    speeds = [round(registry.ledger.tokens_per_s(u)) for u in urls]
    return {**fleet.result(), "calibrated_tokens_per_s": speeds}


def pooled_lru_hit(reqs: Sequence[Request], blocks: int) -> float:
    cache, hit, total = LRU(blocks), 0, 0
    for req in reqs:
        hit += min(cache.serve(req.blocks) * TRACE_BLOCK, req.tokens)
        total += req.tokens
    return hit / total


def router_settings(n: int, args: argparse.Namespace, legacy: bool) -> RouterSettings:
    base = RouterSettings(model="", served_model_name=MODEL, block_size=TRACE_BLOCK,
                          static_prefill=tuple(f"http://sim-{w}" for w in range(n)))
    if legacy:                                                      # index: the fixed 65,536 blocks
        return replace(base, scorer_weights=LEGACY_WEIGHTS, placement_filters=LEGACY_FILTERS)
    ours = replace(base, static_cache_tokens=args.cache_blocks * TRACE_BLOCK)
    if args.scorers:
        ours = replace(ours, scorer_weights=tuple(
            (k, v if isinstance(v, (int, float)) else (v[0], tuple(v[1].items())))
            for k, v in json.loads(args.scorers).items()))
    return ours


# ---- the run --------------------------------------------------------------------------------------

def one_setting(rows: Sequence[dict[str, Any]], n: int, load: float, args: argparse.Namespace) -> dict[str, Any]:
    reqs = scaled(rows, load, n * args.tokens_per_s)
    policies: dict[str, dict[str, Any]] = {
        "oracle": run_simple(reqs, n, args, earliest_free, shared_cache=True),
        "kimi-pd": run_router(reqs, n, args, router_settings(n, args, legacy=False)),
        "kimi-pd-index-65536": run_router(reqs, n, args, replace(router_settings(n, args, legacy=False),
                                                                 static_cache_tokens=0)),
        "previous-default": run_router(reqs, n, args, router_settings(n, args, legacy=True)),
        "round-robin": run_simple(reqs, n, args, round_robin),
        "least-loaded": run_simple(reqs, n, args, least_loaded),
    }
    pooled = pooled_lru_hit(reqs, n * args.cache_blocks)
    oracle_p99 = policies["oracle"]["ttft_p99_s"]
    for res in policies.values():
        res["hit_vs_pooled_lru"] = res["hit_ratio"] / pooled
        res["p99_vs_oracle"] = res["ttft_p99_s"] / oracle_p99
    ours = policies["kimi-pd"]
    return {"workers": n, "load": load, "requests": len(reqs), "seconds_simulated": reqs[-1].arrival,
            "pooled_lru_hit": pooled, "policies": policies,
            "goal_met": ours["hit_vs_pooled_lru"] >= GOAL_HIT and ours["p99_vs_oracle"] <= GOAL_P99}


def table(results: Sequence[dict[str, Any]]) -> str:
    head = (f"{'trace':<13}{'W':>2}{'load':>5} {'policy':<20}{'hit':>7}{'/pooled':>8}"
            f"{'p50 s':>8}{'p99 s':>8}{'/oracle':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        for name, p in r["policies"].items():
            lines.append(f"{r['trace']:<13}{r['workers']:>2}{r['load']:>5} {name:<20}{p['hit_ratio']:>7.3f}"
                         f"{p['hit_vs_pooled_lru']:>8.3f}{p['ttft_p50_s']:>8.2f}{p['ttft_p99_s']:>8.2f}"
                         f"{p['p99_vs_oracle']:>8.2f}")
        lines.append(f"{'':<20} pooled LRU hit {r['pooled_lru_hit']:.3f}; goal met: {r['goal_met']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.placement_replay", description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    p.add_argument("--trace-dir", type=Path, default=TRACES)
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.2])
    p.add_argument("--cache-blocks", type=int, default=8192, help="LRU blocks (512 tokens) per worker")
    p.add_argument("--tokens-per-s", type=float, default=12000.0, help="true prefill speed of each worker")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--report-delay-s", type=float, default=0.25, help="heartbeat -> router (store refresh)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    p.add_argument("--scorers", help='JSON scorer weights for kimi-pd instead of the router default, e.g. '
                   '\'{"completion": [1.0, {"own_weight": 1.5}]}\'')
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if min(args.workers) < 1 or min(args.loads) <= 0 or args.cache_blocks < 1 or args.tokens_per_s <= 0:
        p.error("--workers, --loads, --cache-blocks and --tokens-per-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start, results = time.perf_counter(), []
    for trace in args.traces:
        rows = load_trace(args.trace_dir / f"{trace}_trace.jsonl", args.limit)
        for n in args.workers:
            for load in args.loads:
                print(f"placement_replay: {trace} x {n} workers at load {load} ...", file=sys.stderr, flush=True)
                results.append({"trace": trace, **one_setting(rows, n, load, args)})
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "output"}
    out = {"benchmark": "placement_replay", "config": config, "router_defaults": {
        "scorer_weights": RouterSettings(model="").scorer_weights,
        "prefill_tokens_per_s_guess": RouterSettings(model="").prefill_tokens_per_s},
        "goal": {"hit_vs_pooled_lru_min": GOAL_HIT, "p99_vs_oracle_max": GOAL_P99},
        "all_goals_met": all(r["goal_met"] for r in results), "results": results,
        "seconds": time.perf_counter() - start}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(table(results))
    print(json.dumps({"all_goals_met": out["all_goals_met"], "output": str(args.output)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
