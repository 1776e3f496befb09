"""What one placement costs the router as the fleet grows, with a same-run A/B against another checkout.

Run: `python -m benchmarks.placement_cost [--workers 2 16 64 256] [--slices 20] [--seconds 0.25]
[--baseline-tree DIR]` (DIR: another checkout, e.g. `git worktree add /tmp/base main`); about a minute.

One placement is what the orchestrator does for a prefill-decode request before any leg is sent:
`registry.states()` (one `WorkerState` per worker), the routing context (the prompt hashed, every
worker's cached prefix read), the decode pick (filters, scorers, picker), the prefill candidates and
the prefill pick, and the prefix index's record of the send. Half the static workers are prefill, half
decode, on the router's default policy; 64 prompts share a 600-token prefix and differ in a 70-token
tail, as the router_overhead benchmark's do. A placement walks the whole fleet, so its cost grows with
the fleet while a request's other work does not: at some size it is most of what a request costs.

Each tree is timed in a child process of its own (its modules first on the path, as
`benchmarks.services.checkout_path` gives), kept for the whole run; the trees take turns in short slices
(the order flipped every slice), so the bursts of a noisy host land on both alike, and the table shows
each tree's median slice. On the shared 2-core host the same slice varied up to 1.7x between runs a few
seconds apart, which a few long rounds per tree did not average out.
Writes benchmarks/results/placement_cost.json and a table beside it (benchmarks/results/placement_cost.md),
with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


class Fleet:
    """A router's placement state over `n` static workers (half prefill, half decode), default policy."""

    def __init__(self, n: int) -> None:
        from router.placement.pipeline import build_pipeline
        from router.registry import WorkerRegistry
        from router.settings import RouterSettings
        urls = tuple(f"http://10.0.{i // 250}.{i % 250 + 1}:8200" for i in range(n))
        half = max(n // 2, 1)
        self.settings = RouterSettings(model=None, static_prefill=urls[:half], static_decode=urls[half:])
        self.registry = WorkerRegistry(self.settings, None)
        self.pipeline = build_pipeline(**self.settings.pipeline_spec())

    def place(self, request_id: str, token_ids: list[int]) -> None:
        """One prefill-decode placement, as the orchestrator makes it before the legs."""
        from dataclasses import replace

        from router.placement.context import build_context
        registry, pipeline = self.registry, self.pipeline
        states = registry.states()
        ctx = build_context(request_id, token_ids, states, registry.index, model=self.settings.served_model_name,
                            role="decode", now=time.time())
        decode = pipeline.pick(ctx, states).worker
        prefill_ctx = replace(ctx, role="prefill")
        passed = pipeline.candidates(prefill_ctx, states)
        pipeline.pick_among(prefill_ctx, [w for w in passed if w.info.role == "prefill"])
        registry.index.record_sent(decode.info.worker_id, ctx.hashes_for(decode.info))


def timed(work: Callable[[int], object], seconds: float) -> float:
    """µs per call of `work(i)`, called in batches of 50 for about `seconds`."""
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for i in range(count, count + 50):
            work(i)
        count += 50
    return elapsed / count * 1e6


def child() -> None:
    """In the tree on the path, until stdin closes: for each line `<workers> <seconds>`, one line of JSON with
    the µs per placement and per `states()` over a fleet of that size (kept between lines, warmed on first
    use). Imports only the router's own modules, so an older checkout without this file is measured the
    same way."""
    import random
    rng = random.Random(0)
    prefix = [rng.randrange(100_000) for _ in range(600)]
    prompts = [prefix + [rng.randrange(100_000) for _ in range(70)] for _ in range(64)]
    fleets: dict[int, Fleet] = {}
    for line in sys.stdin:
        size, seconds = int(line.split()[0]), float(line.split()[1])
        fleet = fleets.get(size)
        if fleet is None:
            fleet = fleets[size] = Fleet(size)
            for i in range(200):                       # warm: the hash memo, the index, the code paths
                fleet.place(f"w{i}", prompts[i % 64])

        def place(i: int, fleet: Fleet = fleet) -> None:
            fleet.place(f"r{i}", prompts[i % 64])

        cell = {"placement_us": timed(place, seconds),
                "states_us": timed(lambda _i, fleet=fleet: fleet.registry.states(), seconds / 4)}
        print(json.dumps(cell), flush=True)


def measure(trees: dict[str, Path], sizes: list[int], slices: int, seconds: float) -> dict[str, Any]:
    """`slices` short timings per tree and fleet size, the trees taking turns (benchmarks/paired_trees.py);
    the medians are what the table shows."""
    from benchmarks.paired_trees import alternate, medians, paired_ratio  # parent only: a child runs in an older tree
    runs = alternate(trees, Path(__file__).resolve(), [f"{n} {seconds}" for n in sizes], slices)
    runs = {name: {request.split()[0]: cells for request, cells in per.items()} for name, per in runs.items()}
    doc: dict[str, Any] = {"runs": runs, "median": medians(runs)}
    if len(trees) == 2:                # slice by slice: the pair ran within half a second of each other
        ours, base = list(trees)
        doc["paired_ratio"] = paired_ratio(runs, ours, base, "placement_us")
    return doc


def table(doc: dict[str, Any]) -> str:
    from benchmarks.paired_trees import table as paired_table
    return paired_table(doc, "workers", {"placement_us": "placement µs", "states_us": "states() µs"}, "placement")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 16, 64, 256], help="static fleet sizes")
    p.add_argument("--slices", type=int, default=20, help="timings per fleet size and tree, the trees taking turns")
    p.add_argument("--seconds", type=float, default=0.25, help="length of one slice")
    p.add_argument("--baseline-tree", type=Path, help="another checkout, timed beside this one")
    p.add_argument("--output", type=Path, default=RESULTS / "placement_cost.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(n < 2 for n in args.workers):
        p.error("--workers: each fleet needs at least 2 workers (a prefill and a decode)")
    if args.child:
        child()
        return 0
    from benchmarks.paired_trees import result_doc, write_result
    trees = {"ours": ROOT} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    doc = result_doc(sys.argv[1:] if argv is None else argv, trees, workers=args.workers, slices=args.slices,
                     seconds=args.seconds)
    doc |= measure(trees, args.workers, args.slices, args.seconds)
    text = table(doc)
    write_result(doc, args.output, "Placement cost per request", "benchmarks.placement_cost", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
