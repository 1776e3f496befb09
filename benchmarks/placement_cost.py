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
import os
import statistics
import subprocess
import sys
import tempfile
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


class Child:
    """One tree's measuring process (its modules first on the path, as `checkout_path` gives)."""

    def __init__(self, tree: Path) -> None:
        from benchmarks.services import checkout_path
        env = {**os.environ, "PYTHONPATH": checkout_path(tree, os.environ.get("PYTHONPATH", ""))}
        self.tree = tree
        # a file, not a pipe: a chatty child never blocks on it; closed in close()
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child"], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True)

    def measure(self, size: int, seconds: float) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{size} {seconds}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.errors.seek(0)
            raise RuntimeError(f"the placement child for {self.tree} failed:\n{self.errors.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()                          # closes its pipes
        self.errors.close()


def measure(trees: dict[str, Path], sizes: list[int], slices: int, seconds: float) -> dict[str, Any]:
    """`slices` short timings per tree and fleet size, the trees taking turns slice by slice (order flipped
    every slice) so that a noisy neighbour's bursts land on both; the medians are what the table shows."""
    children: dict[str, Child] = {}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {str(n): [] for n in sizes} for name in trees}
    try:
        for name, tree in trees.items():
            children[name] = Child(tree)
        for size in sizes:
            for k in range(slices):
                for name in (list(trees) if k % 2 == 0 else list(reversed(trees))):
                    runs[name][str(size)].append(children[name].measure(size, seconds))
    finally:
        for c in children.values():
            c.close()
    medians = {name: {size: {key: statistics.median(cell[key] for cell in cells) for key in cells[0]}
                      for size, cells in per_size.items()} for name, per_size in runs.items()}
    doc: dict[str, Any] = {"runs": runs, "median": medians}
    if len(trees) == 2:                # slice by slice: the pair ran within half a second of each other
        ours, base = list(trees)
        doc["paired_ratio"] = {str(n): statistics.median(
            a["placement_us"] / b["placement_us"] for a, b in zip(runs[ours][str(n)], runs[base][str(n)], strict=True))
            for n in sizes}
    return doc


def table(doc: dict[str, Any]) -> str:
    med = doc["median"]
    names = list(med)
    head = "| workers | " + " | ".join(f"{n} placement µs | {n} states() µs" for n in names)
    ratio = len(names) == 2
    lines = [head + (" | placement, ours / baseline (median of paired slices) |" if ratio else " |"),
             "|---" * (1 + 2 * len(names) + ratio) + "|"]
    for size in med[names[0]]:
        cells = [f"{med[n][size]['placement_us']:.1f} | {med[n][size]['states_us']:.1f}" for n in names]
        extra = f" | {doc['paired_ratio'][size]:.2f}x" if ratio else ""
        lines.append(f"| {size} | " + " | ".join(cells) + extra + " |")
    return "\n".join(lines)


def _commit(tree: Path) -> str | None:
    """The checkout's commit (and `+changes` when its tree differs from it), or None outside git."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


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
    trees = {"ours": ROOT} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    doc: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv,
                           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "commits": {name: _commit(tree) for name, tree in trees.items()},
                           "loadavg_start": list(os.getloadavg()), "cpus": os.cpu_count(),
                           "python": sys.version.split()[0], "workers": args.workers, "slices": args.slices,
                           "seconds": args.seconds, "trees": {k: str(v) for k, v in trees.items()}}
    doc |= measure(trees, args.workers, args.slices, args.seconds)
    doc["loadavg_end"] = list(os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    text = table(doc)
    trees_line = ", ".join(f"{name} {doc['commits'][name] or doc['trees'][name]}" for name in trees)
    args.output.with_suffix(".md").write_text(
        f"# Placement cost per request\n\n`python -m benchmarks.placement_cost {' '.join(doc['argv'])}`, "
        f"{doc['when']} ({trees_line}; docs/router-performance.md reads it)\n\n{text}\n\nload average "
        f"{doc['loadavg_start'][0]:.2f} -> {doc['loadavg_end'][0]:.2f}, {doc['cpus']} cpus\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
