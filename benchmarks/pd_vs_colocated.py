"""The P/D claim, measured: short chats' decode TPOT and TTFT while bursts of long prompts arrive,
on a colocated fleet and on a P/D fleet with the same number of workers.

Run: `python -m benchmarks.pd_vs_colocated [--preset tiny] [--duration 40] [--short-rate 3]
[--burst-every 5] [--burst-size 3] [--long-len 1536]`.

Fleets (each: embedded Valkey, the workers, one router; real processes on free 127.0.0.1 ports,
OMP_NUM_THREADS=1 per worker so 2 workers use 2 cores):

- colocated: 2 `kimi-pd worker` (prefill and decode in one engine each), the router places requests;
- pd: 1 `kimi-pd prefill` + 1 `kimi-pd decode`, router `--disagg-threshold T` (default 256: short
  chats go decode-only, long prompts are prefilled on P and pulled by D);
- pd-all (with `--pd-all`): the same with threshold 0, every request through the prefill worker.

Workload, identical for every fleet (seeded, `kimi_pd.bench` prompts of exact token lengths):
steady short chats (Poisson at --short-rate, --short-len prompt tokens, --short-out output tokens,
--ignore-eos) plus, every --burst-every seconds, --burst-size long prompts (--long-len tokens,
--long-out output tokens) sent at once. Metrics (vllm bench definitions) for the short requests
only: TPOT p99 and TTFT p99 (also mean/median), plus the long requests' TTFT. Each fleet first
runs the short chats alone ("quiet", the fleet's own baseline), then the mixed workload; --rounds
alternates the fleets' order and pools the samples, so machine-load drift hits both. Goal: TPOT p99 (P/D)
<= 0.5x colocated and TTFT p99 (P/D) <= 1.2x colocated. Writes benchmarks/results/pd_vs_colocated.json
and a CDF figure benchmarks/results/pd_vs_colocated.png.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kimi_pd.bench import metrics as bench_metrics
from kimi_pd.bench.client import COMPLETIONS, RequestSettings
from kimi_pd.bench.datasets import SampleRequest, sample_random
from kimi_pd.bench.runner import RunSettings, run_requests
from kimi_pd.bench.tokenizer import TokenPool, load_tokenizer
from shared.net import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SECRET = "pd-vs-colocated-transfer-secret-0123"
ADMIN = "pd-vs-colocated-admin"
GOAL_TPOT_RATIO, GOAL_TTFT_RATIO = 0.5, 1.2


# ---- processes ------------------------------------------------------------------------------------

class Procs:
    """Child processes in their own sessions, stopped (SIGTERM, then SIGKILL) when the block ends."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:      # the child keeps its own copy of the fd
            proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", *argv], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def wait(self, url: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead:
                tail = (self.log_dir / f"{dead[0]}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{dead[0]} exited during start-up:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{url} not ready after {timeout_s} s")

    def close(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


@contextlib.contextmanager
def fleet(kind: str, model: Path, log_dir: Path, args: argparse.Namespace):
    """Store + 2 workers + router; yields the router URL."""
    from shared.store.embedded import EmbeddedValkey
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KIMI_PD_TRANSFER_SECRET": SECRET, "KIMI_PD_ADMIN_TOKEN": ADMIN, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    roles = ["worker", "worker"] if kind == "colocated" else ["prefill", "decode"]
    threshold = {"colocated": args.pd_threshold, "pd": args.pd_threshold, "pd-all": 0}[kind]
    procs = Procs(log_dir)
    with EmbeddedValkey() as store:
        try:
            common = ["--model", str(model), "--redis-url", store.url, "--namespace", kind, "--max-num-seqs",
                      str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--cache-memory", args.cache_memory, "--log-level", "warning"]
            urls = []
            for i, role in enumerate(roles):
                port = free_port()
                procs.spawn(f"{role}-{i}", [role, *common, "--port", str(port), "--worker-id", f"{role}-{i}"], env)
                urls.append(f"http://127.0.0.1:{port}/health")
            for url in urls:
                procs.wait(url)
            port = free_port()
            procs.spawn("router", ["router", "--model", str(model), "--redis-url", store.url, "--namespace", kind,
                                   "--port", str(port), "--disagg-threshold", str(threshold), "--log-level", "warning"],
                        {**env, "OMP_NUM_THREADS": "1"})
            url = f"http://127.0.0.1:{port}"
            procs.wait(url + "/ready")
            yield url
        finally:
            procs.close()


# ---- workload -------------------------------------------------------------------------------------

def workload(pool: TokenPool, args: argparse.Namespace) -> list[SampleRequest]:
    """Short chats on a Poisson schedule plus bursts of long prompts; the same for every fleet."""
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1.0 / args.short_rate, size=int(args.short_rate * args.duration * 2) + 10)
    times = np.cumsum(gaps)
    times = times[times < args.duration]
    short = sample_random(pool, len(times), args.short_len, args.short_out, range_ratio=0.25, seed=args.seed)
    bursts = np.arange(args.burst_every / 2, args.duration, args.burst_every)
    long = sample_random(pool, len(bursts) * args.burst_size, args.long_len, args.long_out, seed=args.seed + 1)
    out = [dataclasses.replace(r, request_id=f"short-{i}", arrival_s=float(t))
           for i, (r, t) in enumerate(zip(short, times, strict=False))]
    out += [dataclasses.replace(r, request_id=f"long-{i}", arrival_s=float(bursts[i // args.burst_size]))
            for i, r in enumerate(long)]
    return sorted(out, key=lambda r: r.arrival_s)


def warm_up(url: str, pool: TokenPool, args: argparse.Namespace) -> None:
    """A few requests of both kinds, so first-call costs (allocations, code paths) stay out of the run."""
    reqs = sample_random(pool, 2, args.short_len, 4, seed=999) + sample_random(pool, 1, args.long_len, 2, seed=998)
    for r in reqs:
        body = {"model": "kimi-k3", "prompt": r.prompt, "max_tokens": r.expected_output_len, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


def send(url: str, requests: list[SampleRequest]) -> tuple[list, float]:
    settings = RunSettings(request=RequestSettings(url=url + "/v1/completions", backend=COMPLETIONS, model="kimi-k3",
                                                   ignore_eos=True), initial_test=False, disable_tqdm=True)
    return asyncio.run(run_requests(requests, settings))


def summarize(requests: list[SampleRequest], outputs: list, duration_s: float) -> dict[str, Any]:
    """vllm-bench metrics of the short and the long requests separately, with their TPOT/TTFT lists."""
    groups: dict[str, Any] = {"duration_s": duration_s}
    for kind in ("short", "long"):
        subset = [o for r, o in zip(requests, outputs, strict=False) if r.request_id.startswith(kind)]
        if not subset:
            continue
        res = bench_metrics.compute(subset, duration_s, (50.0, 90.0, 99.0), {})
        detail = res.pop("detail")
        ok = [not e for e in detail["errors"]]
        res["tpots_ms"] = [((lat - t) / (n - 1)) * 1e3 for lat, t, n, good in
                           zip(detail["latencies"], detail["ttfts"], detail["output_lens"], ok, strict=False)
                           if good and n > 1]
        res["ttfts_ms"] = [t * 1e3 for t, good in zip(detail["ttfts"], ok, strict=False) if good]
        res["errors"] = sorted({e for e in detail["errors"] if e})[:5]
        groups[kind] = res
    return groups


# ---- report ---------------------------------------------------------------------------------------

def headline(runs: dict[str, dict]) -> dict[str, Any]:
    """Short-request TPOT/TTFT p99 per fleet and phase, and the P/D fleets' ratios to colocated."""
    out: dict[str, Any] = {}
    for name, phases in runs.items():
        row: dict[str, Any] = {}
        for phase, run in phases.items():
            s = run["short"]
            row[phase] = {"short_tpot_p99_ms": s["p99_tpot_ms"], "short_tpot_median_ms": s["median_tpot_ms"],
                          "short_ttft_p99_ms": s["p99_ttft_ms"], "short_ttft_median_ms": s["median_ttft_ms"],
                          "short_itl_p99_ms": s["p99_itl_ms"],
                          "failed": s["failed"] + run.get("long", {}).get("failed", 0)}
            if "long" in run:
                row[phase].update(long_ttft_median_ms=run["long"]["median_ttft_ms"],
                                  long_ttft_p99_ms=run["long"]["p99_ttft_ms"])
        mixed, quiet = row["mixed"], row["quiet"]
        row["burst_inflation_tpot_p99"] = mixed["short_tpot_p99_ms"] / quiet["short_tpot_p99_ms"]
        if name != "colocated":
            base = runs["colocated"]["mixed"]["short"]
            tpot = mixed["short_tpot_p99_ms"] / base["p99_tpot_ms"]
            ttft = mixed["short_ttft_p99_ms"] / base["p99_ttft_ms"]
            row.update(tpot_p99_ratio_vs_colocated=tpot, ttft_p99_ratio_vs_colocated=ttft,
                       goal_tpot_met=tpot <= GOAL_TPOT_RATIO, goal_ttft_met=ttft <= GOAL_TTFT_RATIO)
        out[name] = row
    return out


def figure(runs: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, phases in runs.items():
        run = phases["mixed"]
        columns = (run["short"]["tpots_ms"], run["short"]["ttfts_ms"], run["long"]["ttfts_ms"])
        for ax, values in zip(axes, columns, strict=True):
            v = np.sort(values)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
    titles = ("short chats: TPOT (ms)", "short chats: TTFT (ms)", "long prompts: TTFT (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("P/D vs colocated, same 2 workers: steady short chats + bursts of long prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pd_vs_colocated", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: a generated --preset one)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per fleet")
    p.add_argument("--short-rate", type=float, default=3.0, help="short chats per second (Poisson)")
    p.add_argument("--short-len", type=int, default=48)
    p.add_argument("--short-out", type=int, default=32)
    p.add_argument("--burst-every", type=float, default=5.0)
    p.add_argument("--burst-size", type=int, default=3)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--long-out", type=int, default=2)
    p.add_argument("--pd-threshold", type=int, default=256, help="router --disagg-threshold of the pd fleet")
    p.add_argument("--pd-all", action="store_true", help="also run P/D with threshold 0 (every prompt on P)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cache-memory", default="256MiB")
    p.add_argument("--rounds", type=int, default=2, help="fleet runs each, alternating order; results pooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=RESULTS / "pd_vs_colocated.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the cleanup (stop the fleets) on SIGTERM
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pd-vs-colocated-") as tmp:
        tmp_dir = Path(tmp)
        if args.model is None:
            from engine.checkpoint.create import create_checkpoint
            model = Path(create_checkpoint(args.preset, tmp_dir / args.preset, seed=0, progress=False))
        else:
            model = args.model
        pool = TokenPool.of(load_tokenizer(model))
        mixed = workload(pool, args)
        quiet = [r for r in mixed if r.request_id.startswith("short")]
        kinds = ["colocated", "pd", *(["pd-all"] if args.pd_all else [])]
        collected: dict[str, dict[str, list]] = {k: {"quiet": [], "mixed": []} for k in kinds}
        per_round = []
        for rnd in range(args.rounds):
            order = kinds if rnd % 2 == 0 else kinds[::-1]           # alternate, so load drift hits both
            this_round = {}
            for kind in order:
                print(f"pd_vs_colocated: round {rnd + 1}/{args.rounds}, {kind} fleet: {len(quiet)} quiet then "
                      f"{len(mixed)} mixed requests", file=sys.stderr, flush=True)
                with fleet(kind, model, tmp_dir / f"{kind}-{rnd}", args) as url:
                    warm_up(url, pool, args)
                    for phase, reqs in (("quiet", quiet), ("mixed", mixed)):
                        outputs, duration = send(url, reqs)
                        collected[kind][phase].append((reqs, outputs, duration))
                        this_round.setdefault(kind, {})[phase] = summarize(reqs, outputs, duration)
            per_round.append(headline(this_round))
        runs = {kind: {phase: summarize([r for reqs, _, _ in items for r in reqs],
                                        [o for _, outs, _ in items for o in outs],
                                        sum(d for _, _, d in items))
                       for phase, items in phases.items()}
                for kind, phases in collected.items()}
    result = {"benchmark": "pd_vs_colocated", "config": {k: str(v) if isinstance(v, Path) else v
                                                          for k, v in vars(args).items()},
              "machine": {"cpus": os.cpu_count(), "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
              "goal": {"tpot_p99_ratio_max": GOAL_TPOT_RATIO, "ttft_p99_ratio_max": GOAL_TTFT_RATIO},
              "headline": headline(runs), "per_round": per_round, "runs": runs,
              "seconds": time.perf_counter() - started}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    figure(runs, args.output.with_suffix(".png"))
    print(json.dumps(result["headline"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
