"""Latency, requests/s and CPU per request the router adds in front of model-free stub workers,
side by side with nginx, vllm-router and sglang-router.

Run: `python -m benchmarks.router_overhead [--seconds 2] [--rounds 3] [--concurrency 1 32]
[--kinds chat chat_stream] [--modes decode-only prefill-decode] [--router-workers N] [--no-peers]
[--no-python-floor] [--baseline-tree DIR] [--stages]` (DIR: another checkout, e.g. a worktree of main, whose
router runs beside ours as `router_baseline`: a same-run A/B of two trees; `--stages`: our router also runs cut
short after each stage of its request path, `router@front` ... `router@placed` (benchmarks/router_stages.py),
and the summary says what each stage adds to the CPU per request, beside sglang-router's whole figure).

Starts a prefill and a decode stub worker (tests.stub_worker on its bare fast server), our router
(`python -m kimi_pd router`, with `--workers N` when N > 1) and the peers (benchmarks/peers.py) on
free 127.0.0.1 ports, once per mode:

- decode-only (`--disagg-threshold 100000`): one leg, router -> decode stub; the baseline is the
  same request sent straight to the decode stub ("direct");
- prefill-decode (`--disagg-threshold 0`): a prefill leg, then the decode leg; the baselines are the
  decode stub given fixed `kv_transfer_params` ("direct") and the prefill leg alone
  ("direct_prefill"): a client doing P then D itself would wait for their sum. In decode-only mode
  `python_floor` (benchmarks/python_floor.py) forwards the bytes unchanged on uvloop + httptools: the
  least any Python proxy costs here, so what is left to gain in Python is ours minus the floor.

The load generator is wrk (benchmarks/loadgen.py), closed loop: at 1 connection its mean latency
is the latency, at 32 its requests/s the throughput. Each round runs every target at every
concurrency for `--seconds`, targets rotated per round so drift hits all alike. For every run: the
CPU seconds the target's process tree used (/proc, children included) per request served, wrk's
own CPU per request, and the stubs' leg counters, which must show the legs the target implies (else
the figures measure something else). "direct" at 32 connections is the generator's headroom: wrk
and a stub alone, no router between; `generator_cores` beside it is the share of a core wrk itself used
while driving each target (a single-process stub can be slower at 32 connections than a proxy with a few
pooled ones, so the first ratio alone can read below 1 with wrk far from busy). Writes
benchmarks/results/router_overhead.json and a table beside it (benchmarks/results/router_overhead_latest.md);
the load average at start and end is in `machine`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen import LoadGenError, Run, run_wrk, write_script, wrk_binary
from benchmarks.peers import PEER_PACKAGES, ensure_venv, peers_for, proc_usage
from benchmarks.router_stages import STAGES, legs_served
from benchmarks.services import BenchError, cpu_model, router, service, stub_worker
from shared.net import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "router_overhead.json"
MODES = {"decode-only": 100000, "prefill-decode": 0}      # mode -> router --disagg-threshold
CHAT = "/v1/chat/completions"
MODEL = "kimi-k3"
FILLER = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
          "quietly", "hex", "every", "bold", "juror", "near", "the", "old", "mill")
Body = dict[str, Any]
STAGE_MARK = "@"                 # router@front ...: our router cut short after a stage (benchmarks/router_stages.py)
# the legs a target's request makes the stubs serve: (stub, leg kind)
PD_LEGS = (("prefill", "prefill"), ("decode", "decode"))
LEGS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {"decode-only": {"*": (("decode", "local"),)},
        "prefill-decode": {"direct": (("decode", "decode"),), "direct_prefill": (("prefill", "prefill"),),
                           "sglang-router": (("prefill", "local"), ("decode", "local")), "*": PD_LEGS}}


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    pid: int | None = None                       # the process tree charged for CPU; None: a stub (direct)
    extra: Body = field(default_factory=dict)    # fields every body sent to it carries
    concurrency: tuple[int, ...] | None = None   # None: every --concurrency
    metrics_url: str | None = None               # our router under --workers N: /metrics, for the spread


def bodies(words: int, count: int, stream: bool, extra: Body) -> list[Body]:
    """Chat bodies with a shared prefix of `words` words and a per-request suffix."""
    prefix = " ".join(FILLER[i % len(FILLER)] for i in range(words))
    out = [{"model": MODEL, "messages": [{"role": "user", "content": f"{prefix} (request {i})"}], **extra}
           for i in range(count)]
    return [{**b, "stream": True} for b in out] if stream else out


# ---- one run ------------------------------------------------------------------------------------

def stub_counts(urls: dict[str, str]) -> Counter:
    out: Counter = Counter()
    for stub, url in urls.items():
        for kind, n in httpx.get(f"{url}/stats", timeout=5).json().items():
            out[(stub, kind)] = n
    return out


def settled_counts(urls: dict[str, str], read: Callable[[dict[str, str]], Counter] = stub_counts,
                   quiet_s: float = 0.05, limit_s: float = 2.0) -> Counter:
    """The stubs' leg counters once they stop moving: the requests a previous wrk run left in flight are
    still being served when it exits (on a fast host more than a run's own connections), and must not
    land in the next run's count. Gives up waiting after `limit_s`."""
    deadline, last = time.monotonic() + limit_s, read(urls)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read(urls)
        if now == last:
            break
        last = now
    return last


_SERVED = re.compile(r'^kimi_pd_router_process_requests_total\{process="(\d+)"\} ([0-9.e+]+)$', re.M)


def served_by_process(exposition: str) -> dict[str, float]:
    """Requests each router process has served so far, from `/metrics` text
    (`kimi_pd_router_process_requests_total{process="i"}`)."""
    return {proc: float(n) for proc, n in _SERVED.findall(exposition)}


def process_requests(metrics_url: str) -> dict[str, float]:
    return served_by_process(httpx.get(metrics_url, timeout=5).text)


def spread(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """How evenly one run's requests fell on the router's processes: each one's count, and the busiest
    one's over the mean (1.0: even; N: one process served everything). The kernel hands a shared
    socket's connections to whichever process accepts first, and wrk keeps its connections open, so an
    uneven spread at start stays for the whole run."""
    counts = [after.get(p, 0.0) - before.get(p, 0.0) for p in sorted(after, key=int)]
    mean = sum(counts) / len(counts) if counts else 0.0
    return {"process_requests": [int(c) for c in counts],
            "process_spread": round(max(counts) / mean, 2) if mean else None}


def check_legs(mode: str, target: str, run: Run, seen: Counter, connections: int) -> None:
    """Each leg the target implies was served once per counted request (plus at most the requests in
    flight when wrk stopped); no other leg was served."""
    stage = target.partition(STAGE_MARK)[2]
    legs = legs_served(stage, mode) if stage else LEGS[mode].get(target, LEGS[mode]["*"])
    for key, n in seen.items():
        low, high = (run.requests, run.requests + connections) if key in legs else (0, 0)
        if not low <= n <= high:
            raise BenchError(f"{mode}/{target}: the stubs served {n} {key} legs for {run.requests} requests "
                             f"(expected {low}..{high}; legs by kind: {dict(seen)})")
    if run.errors:
        raise BenchError(f"{mode}/{target}: wrk saw errors {run.errors} in {run.requests} requests")


def one_run(mode: str, target: Target, script: Path, connections: int, seconds: int,
            stubs: dict[str, str]) -> dict[str, Any]:
    """One wrk run: its figures, the target's CPU per request, the legs checked."""
    legs_before = settled_counts(stubs)
    served_before = process_requests(target.metrics_url) if target.metrics_url else {}
    cpu_before = proc_usage(target.pid)[0] if target.pid else 0.0
    run = run_wrk(target.url, script, connections, seconds)
    row: dict[str, Any] = {"requests": run.requests, "requests_per_s": round(run.requests_per_s, 1),
                           "mean_us": run.mean_us, "p50_us": run.p50_us, "p99_us": run.p99_us,
                           "generator_cpu_us_per_request": round(run.generator_cpu_s / max(1, run.requests) * 1e6, 1)}
    if target.pid:
        cpu, rss = proc_usage(target.pid)
        row["cpu_us_per_request"] = round((cpu - cpu_before) / max(1, run.requests) * 1e6, 1)
        row["rss_mb"] = round(rss / 2**20, 1)
    if target.metrics_url:
        row.update(spread(served_before, process_requests(target.metrics_url)))
    check_legs(mode, target.name, run, stub_counts(stubs) - legs_before, connections)
    return row


def measure_mode(mode: str, targets: list[Target], stubs: dict[str, str], args: argparse.Namespace,
                 tmp: Path) -> dict[str, Any]:
    """Warm-up, then `args.rounds` interleaved rounds: kind x concurrency x target (rotated)."""
    scripts = {(t.name, kind): write_script(tmp / f"{mode}-{t.name}-{kind}.lua",
                                            bodies(args.prompt_words, 64, kind == "chat_stream", t.extra))
               for t in targets for kind in args.kinds}
    for t in targets:
        for kind in args.kinds:
            one_run(mode, t, scripts[(t.name, kind)], max(args.concurrency), args.warmup_seconds, stubs)
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    for r in range(args.rounds):
        order = targets[r % len(targets):] + targets[:r % len(targets)]
        for kind in args.kinds:
            for c in args.concurrency:
                for t in order:
                    if t.concurrency is None or c in t.concurrency:
                        row = one_run(mode, t, scripts[(t.name, kind)], c, args.seconds, stubs)
                        runs.setdefault(kind, {}).setdefault(str(c), {}).setdefault(t.name, []).append(row)
    return runs


# ---- targets ------------------------------------------------------------------------------------

def pd_extras(prefill_url: str) -> tuple[Body, Body]:
    """(the decode leg's fixed kv_transfer_params, the prefill leg's fields) for the direct targets."""
    leg = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
           "kv_transfer_params": {"do_remote_decode": True}}
    ktp = httpx.post(prefill_url + CHAT, json=leg, timeout=5).json()["kv_transfer_params"]
    return ({"kv_transfer_params": ktp},
            {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})


def run_mode(mode: str, model: Path, stubs: dict[str, str], args: argparse.Namespace, tmp: Path,
             bin_dir: Path | None) -> dict[str, Any]:
    port = free_port()
    ports = {k: free_port()
             for k in ("nginx", "vllm-router", "vllm-router-prom", "sglang-router", "sglang-router-prom")}
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(router(port, MODES[mode], stubs["prefill"], stubs["decode"], model, args, tmp))
        metrics_url = f"http://127.0.0.1:{port}/metrics" if args.router_workers > 1 else None
        targets = [Target("direct", stubs["decode"] + CHAT),
                   Target("router", f"http://127.0.0.1:{port}{CHAT}", ours.pid, metrics_url=metrics_url)]
        if args.baseline_tree:
            base_port = free_port()
            base = stack.enter_context(router(base_port, MODES[mode], stubs["prefill"], stubs["decode"], model, args,
                                              tmp, tree=args.baseline_tree, name="router-baseline"))
            targets.append(Target("router_baseline", f"http://127.0.0.1:{base_port}{CHAT}", base.pid))
        for stage in STAGES if args.stages else ():
            stage_port = free_port()
            cut = stack.enter_context(router(stage_port, MODES[mode], stubs["prefill"], stubs["decode"], model, args,
                                             tmp, name=f"router-{stage}",
                                             entry=("-m", "benchmarks.router_stages", "--stage", stage)))
            targets.append(Target(f"router{STAGE_MARK}{stage}", f"http://127.0.0.1:{stage_port}{CHAT}", cut.pid))
        if mode == "decode-only" and args.python_floor:
            floor_port = free_port()
            floor = stack.enter_context(service("python-floor", ["-m", "benchmarks.python_floor", "--port",
                                                                 str(floor_port), "--upstream", stubs["decode"]],
                                                f"http://127.0.0.1:{floor_port}/health", tmp, args.startup_timeout))
            targets.append(Target("python_floor", f"http://127.0.0.1:{floor_port}{CHAT}", floor.pid))
        if mode == "prefill-decode":
            decode_extra, prefill_extra = pd_extras(stubs["prefill"])
            targets[0] = Target("direct", stubs["decode"] + CHAT, extra=decode_extra)
            targets.append(Target("direct_prefill", stubs["prefill"] + CHAT, extra=prefill_extra, concurrency=(1,)))
        peers = peers_for(mode, stubs["prefill"], stubs["decode"], ports, tmp, bin_dir) if args.peers else []
        for peer in peers:
            url = f"http://127.0.0.1:{ports[peer.name]}"
            try:
                proc = stack.enter_context(service(f"{peer.name}-{mode}", peer.args, url + peer.ready_path, tmp,
                                                   args.startup_timeout, program=peer.program))
            except BenchError as exc:
                skipped[peer.name] = str(exc)[:500]
                continue
            targets.append(Target(peer.name, url + CHAT, proc.pid))
        start = time.perf_counter()
        runs = measure_mode(mode, targets, stubs, args, tmp)
    return {"router_disagg_threshold": MODES[mode], "seconds": round(time.perf_counter() - start, 1),
            "peers_skipped": skipped, "runs": runs}


# ---- summary ------------------------------------------------------------------------------------

def _med(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 1)


def _cell(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rps = [r["requests_per_s"] for r in rows]
    cell: dict[str, Any] = {"requests_per_s": _med(rows, "requests_per_s"), "range": [min(rps), max(rps)],
                            "mean_us": _med(rows, "mean_us"), "p99_us": _med(rows, "p99_us"),
                            "generator_cpu_us_per_request": _med(rows, "generator_cpu_us_per_request")}
    if "cpu_us_per_request" in rows[0]:
        cell["cpu_us_per_request"] = _med(rows, "cpu_us_per_request")
        cell["rss_mb"] = max(r["rss_mb"] for r in rows)
    if "process_spread" in rows[0]:
        cell["process_spread"] = [r["process_spread"] for r in rows]      # per round: the spread is set at connect
    return cell


def _added_us(per_target: dict[str, list[dict[str, Any]]], name: str, mode: str, stat: str = "mean_us") -> float:
    """Median over rounds of (target's latency `stat` - the baseline's of the same round)."""
    base = [r[stat] for r in per_target["direct"]]
    if mode == "prefill-decode" and "direct_prefill" in per_target:
        base = [d + p[stat] for d, p in zip(base, per_target["direct_prefill"], strict=False)]
    return round(statistics.median(r[stat] - b for r, b in zip(per_target[name], base, strict=False)), 1)


def summarize_mode(mode: str, runs: dict[str, Any]) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    for kind, per_c in runs.items():
        for c, per_target in per_c.items():
            for name, rows in per_target.items():
                cell = _cell(rows)
                if c == "1" and not name.startswith("direct"):
                    cell["added_latency_us"] = _added_us(per_target, name, mode)
                    cell["added_p50_us"] = _added_us(per_target, name, mode, "p50_us")
                cells.setdefault(name, {})[f"{kind}_c{c}"] = cell
    ours, ratios = cells.get("router", {}), {}
    for peer, row in cells.items():
        if peer.startswith("direct") or peer == "router" or STAGE_MARK in peer:
            continue                              # router_baseline: the --baseline-tree router, a peer like the others
        ratio: dict[str, float] = {}
        for key, cell in row.items():
            mine = ours.get(key, {})
            for stat in ("requests_per_s", "cpu_us_per_request", "added_latency_us"):
                if cell.get(stat) and stat in mine:
                    ratio[f"{key}_{stat}"] = round(mine[stat] / cell[stat], 2)
        ratios[f"router_vs_{peer.removeprefix('router_')}"] = ratio
    return {"targets": cells, "ratios": ratios, "stages": stage_costs(cells)}


def stage_costs(cells: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per kind and concurrency, the CPU per request of our router cut after each stage, then whole, each
    with what it adds over the stage before and its share of the whole; sglang-router's whole figure
    beside it (`reference`). Empty without `--stages`."""
    out: dict[str, list[dict[str, Any]]] = {}
    names = [f"router{STAGE_MARK}{s}" for s in STAGES] + ["router"]
    for key in cells.get("router", {}):
        rows = [(name, cells[name][key]["cpu_us_per_request"]) for name in names
                if key in cells.get(name, {}) and "cpu_us_per_request" in cells[name][key]]
        if len(rows) < 2:
            continue
        whole, before = rows[-1][1], 0.0
        out[key] = []
        for name, cpu in rows:
            out[key].append({"stage": name.partition(STAGE_MARK)[2] or "whole", "cpu_us_per_request": cpu,
                             "added_us": round(cpu - before, 1),
                             "share_of_whole": round((cpu - before) / whole, 3) if whole else None})
            before = cpu
        peer = cells.get("sglang-router", {}).get(key, {}).get("cpu_us_per_request")
        if peer:
            out[key].append({"stage": "reference: sglang-router, whole", "cpu_us_per_request": peer})
    return out


def goals(summary: dict[str, Any], kind: str = "chat") -> dict[str, Any]:
    """The issue's goals against sglang-router, same run: requests/s at 32 clients >= its, added
    latency at 1 client <= its, in each mode it ran."""
    out: dict[str, Any] = {}
    for mode, s in summary.items():
        ours, peer = s["targets"].get("router", {}), s["targets"].get("sglang-router")
        if not peer or f"{kind}_c32" not in ours or f"{kind}_c1" not in ours:
            continue
        out[mode] = {"requests_per_s_c32": [ours[f"{kind}_c32"]["requests_per_s"],
                                            peer[f"{kind}_c32"]["requests_per_s"]],
                     "added_latency_us_c1": [ours[f"{kind}_c1"]["added_latency_us"],
                                             peer[f"{kind}_c1"]["added_latency_us"]],
                     "added_p50_us_c1": [ours[f"{kind}_c1"]["added_p50_us"], peer[f"{kind}_c1"]["added_p50_us"]]}
        out[mode]["met"] = (out[mode]["requests_per_s_c32"][0] >= out[mode]["requests_per_s_c32"][1]
                            and out[mode]["added_latency_us_c1"][0] <= out[mode]["added_latency_us_c1"][1])
    return out


def headroom(summary: dict[str, Any]) -> dict[str, Any]:
    """wrk + one stub alone at the highest concurrency against the fastest proxy of the mode, and the cores wrk
    itself used while it drove each target (its CPU per request x requests/s). The first ratio can fall below 1
    (a single-process stub serves 32 connections more slowly than a proxy's few pooled ones); the second says
    directly whether the generator was near a core of its own: far below 1, it was not what limited the target."""
    out: dict[str, Any] = {}
    for mode, s in summary.items():
        for key, direct in s["targets"].get("direct", {}).items():
            proxies = [row[key]["requests_per_s"] for name, row in s["targets"].items()
                       if not name.startswith("direct") and key in row]
            if key.endswith("_c1") or not proxies:
                continue
            out[f"{mode}/{key}"] = {"direct_requests_per_s": direct["requests_per_s"],
                                    "fastest_proxy_requests_per_s": max(proxies),
                                    "headroom": round(direct["requests_per_s"] / max(proxies), 2),
                                    "generator_cpu_us_per_request": direct["generator_cpu_us_per_request"],
                                    "generator_cores": {
                                        name: round(row[key]["generator_cpu_us_per_request"]
                                                    * row[key]["requests_per_s"] / 1e6, 2)
                                        for name, row in s["targets"].items() if key in row}}
    return out


# ---- report -------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    wrk = subprocess.run([wrk_binary(), "--version"], capture_output=True, text=True, check=False)
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(),
            "generator": (wrk.stdout or wrk.stderr).splitlines()[0] if (wrk.stdout or wrk.stderr) else "wrk"}


def markdown(result: dict[str, Any]) -> str:
    """The run's table: per mode, kind and concurrency, each target's requests/s, mean latency, added
    latency (1 client), CPU per request of the target and of wrk."""
    m = result["machine"]
    lines = [f"# router_overhead, latest run ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"`python -m benchmarks.router_overhead {' '.join(result['argv'])}`; {m['generator']}; load average "
             f"{m['load_average_at_start'][0]} -> {m['load_average_at_end'][0]}; {result['seconds']:.0f} s. "
             "Medians of rounds; ratios only within this run.", ""]
    for mode, s in result["summary"].items():
        keys = sorted({k for row in s["targets"].values() for k in row})
        for key in keys:
            lines += [f"## {mode}, {key}", "", "| target | requests/s | mean latency µs | added mean / p50 µs | "
                      "CPU µs/request | wrk CPU µs/request | RSS MB |", "|---|---|---|---|---|---|---|"]
            for name, row in s["targets"].items():
                if key in row:
                    c = row[key]
                    lines.append(f"| {name} | {c['requests_per_s']:,.0f} | {c['mean_us']:,.0f} | "
                                 f"{c.get('added_latency_us', '-')} / {c.get('added_p50_us', '-')} | "
                                 f"{c.get('cpu_us_per_request', '-')} | "
                                 f"{c['generator_cpu_us_per_request']} | {c.get('rss_mb', '-')} |")
            spreads = s["targets"].get("router", {}).get(key, {}).get("process_spread")
            if spreads:
                lines += ["", f"Our processes' spread (busiest over mean, per round): {spreads}"]
            lines.append("")
            if key in s.get("stages", {}):
                lines += [f"Where our router's CPU goes ({mode}, {key}; cut after each stage, same run):", "",
                          "| stage | CPU µs/request | added by the stage µs | share of the whole |",
                          "|---|---|---|---|"]
                lines += [f"| {r['stage']} | {r['cpu_us_per_request']} | {r.get('added_us', '-')} | "
                          f"{r.get('share_of_whole', '-')} |" for r in s["stages"][key]]
                lines.append("")
    lines += ["Goals (ours, sglang-router): " + json.dumps(result["goals"]),
              "", "Headroom: " + json.dumps(result["headroom"]), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=1, help="length of each timed wrk run (whole seconds)")
    p.add_argument("--warmup-seconds", type=int, default=1, help="untimed run per target and kind")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections (clients)")
    p.add_argument("--kinds", nargs="+", choices=("chat", "chat_stream"), default=["chat"],
                   help="non-streamed chat and/or streamed chat (16 chunks)")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per request (stub)")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="stub time per token")
    p.add_argument("--prompt-words", type=int, default=200, help="words in each prompt")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--router-workers", type=int, default=1,
                   help="router processes (--workers N), ours and a --baseline-tree's alike")
    p.add_argument("--baseline-tree", type=Path,
                   help="another checkout (e.g. a worktree of main): its router runs beside ours as router_baseline")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip nginx, vllm-router and sglang-router (else: started side by side with ours)")
    p.add_argument("--no-python-floor", dest="python_floor", action="store_false",
                   help="skip benchmarks/python_floor.py (the least a Python proxy costs; decode-only mode)")
    p.add_argument("--stages", action="store_true",
                   help="also run our router cut short after each stage of its request path (benchmarks/"
                        "router_stages.py): what each stage costs per request, in the same run")
    p.add_argument("--model", type=Path, help="checkpoint dir for the router's tokenizer (default: a tiny one)")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON; the table goes beside it (NAME_latest)")
    args = p.parse_args(argv)
    if min(args.rounds, args.router_workers, *args.concurrency) < 1 or min(args.seconds, args.warmup_seconds) <= 0:
        p.error("--rounds, --router-workers and --concurrency must be >= 1, --seconds and --warmup-seconds > 0")
    return args


def _tiny_checkpoint(tmp: Path) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return Path(create_checkpoint("tiny", tmp / "tiny", progress=False))


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    start, machine = time.perf_counter(), machine_info()
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or _tiny_checkpoint(tmp)
        ports = {"prefill": free_port(), "decode": free_port()}
        stubs = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        bin_dir = ensure_venv() if args.peers else None
        with stub_worker("prefill", ports["prefill"], args, tmp), stub_worker("decode", ports["decode"], args, tmp):
            modes = {}
            for mode in args.modes:
                print(f"router_overhead: measuring {mode} ...", file=sys.stderr, flush=True)
                modes[mode] = run_mode(mode, model, stubs, args, tmp, bin_dir)
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = {mode: summarize_mode(mode, res["runs"]) for mode, res in modes.items()}
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "output"}
    return {"benchmark": "router_overhead", "argv": argv, "machine": machine, "config": config,
            "peers_skipped": {m: r["peers_skipped"] for m, r in modes.items()},
            "peers_not_installed": [] if bin_dir or not args.peers else [p.split("==")[0] for p in PEER_PACKAGES],
            "goals": goals(summary),
            "headroom": headroom(summary), "summary": summary, "modes": modes,
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the cleanup (stop the servers) on SIGTERM
    try:
        result = run(args, argv)
    except (LoadGenError, BenchError) as exc:
        print(f"router_overhead: {exc}", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    args.output.with_name(f"{args.output.stem}_latest").with_suffix(".md").write_text(markdown(result))
    print(json.dumps({k: result[k] for k in ("goals", "headroom", "summary")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
