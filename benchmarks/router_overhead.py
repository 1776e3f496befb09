"""Latency and throughput the router adds in front of model-free stub workers.

Run: `python -m benchmarks.router_overhead [--requests 200] [--concurrency 1 8 32] [--tokens 16]`.

Starts one prefill and one decode stub worker (tests.stub_worker) and the real router
(`python -m kimi_pd router`) on free 127.0.0.1 ports, once per mode:

- decode-only (`--disagg-threshold 100000`): one leg, router -> decode stub;
- prefill-decode (`--disagg-threshold 0`): prefill leg to the prefill stub, then the decode leg.

For non-streaming chat and streaming chat (time to first body byte and whole stream) it compares
the same requests sent to the decode stub directly (in prefill-decode mode with the decode leg's
`kv_transfer_params`) and through the router, interleaved, after a warm-up; in prefill-decode mode
also the client doing both legs itself ("direct_two_legs"), which isolates the router's own cost.
Then requests/s, direct vs router, at fixed concurrencies (httpx.AsyncClient). Every reply is
checked, and the stubs' leg counters must show the router took the legs the mode implies. Prints
JSON and writes benchmarks/results/router_overhead.json. The load generator shares the CPUs with
the servers (and whatever else runs on the machine: see `machine.load_average_*`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.peers import ensure_venv, peers_for, proc_usage
from shared.net import free_port
from tests.stub_worker import token_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "router_overhead.json"
MODES = {"decode-only": 100000, "prefill-decode": 0}      # mode -> router --disagg-threshold
CHAT = "/v1/chat/completions"
MODEL = "kimi-k3"
FILLER = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
          "quietly", "hex", "every", "bold", "juror", "near", "the", "old", "mill")
Body = dict[str, Any]


class BenchError(RuntimeError):
    """A reply that is not what the protocol promises, or a service that would not start."""


# ---- processes ------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if this process dies, so no server outlives a killed benchmark."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{url}: the process exited with {proc.returncode}\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise BenchError(f"{url}: not ready after {timeout_s:.0f} s\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def service(name: str, args: list[str], ready_url: str, log_dir: Path, timeout_s: float,
            program: list[str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `python <args>` (or `program + args`) from the repository root until the block ends; ready
    when ready_url is 200. Yields the process (its pid is what CPU and RSS are read from)."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        # no threads run here (asyncio.run joins its executor before returning), so preexec_fn is safe
        proc = subprocess.Popen([*(program or [sys.executable]), *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509
    try:
        _wait_ready(proc, ready_url, timeout_s, log)
        yield proc
    finally:
        _stop(proc)


def stub_worker(role: str, port: int, args: argparse.Namespace, log_dir: Path):
    cmd = ["-m", "tests.stub_worker", "--port", str(port), "--role", role, "--tokens", str(args.tokens),
           "--token-delay-ms", str(args.token_delay_ms)]
    return service(f"stub-{role}", cmd, f"http://127.0.0.1:{port}/health", log_dir, args.startup_timeout)


def router(port: int, threshold: int, prefill: str, decode: str, model: Path, args: argparse.Namespace,
           log_dir: Path):
    cmd = ["-m", "kimi_pd", "router", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--prefill", prefill, "--decode", decode, "--disagg-threshold", str(threshold), "--log-level", "warning"]
    return service(f"router-t{threshold}", cmd, f"http://127.0.0.1:{port}/ready", log_dir, args.startup_timeout)


# ---- one request ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    ttfb: float          # seconds to the first body byte (the whole reply when not streamed)
    total: float


@dataclass(frozen=True)
class Target:
    name: str
    url: str                                     # where the (decode) request goes
    kv_transfer_params: Body | None = None       # fixed params: the decode stub treats it as a decode leg
    prefill_url: str | None = None               # the client runs the prefill leg itself first


class Client:
    """Sends one request to a target and checks the reply; counts requests per target."""

    def __init__(self, http: httpx.AsyncClient, expected_text: str) -> None:
        self.http, self.expected_text, self.calls, self.retries = http, expected_text, Counter(), Counter()

    async def call(self, target: Target, body: Body) -> Sample:
        self.calls[target.name] += 1
        try:
            return await self._call(target, body)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # a pooled connection its server closed as it was reused (the request never arrived: the
            # stubs' leg counts, checked after the run, would show it otherwise); counted per target
            self.retries[target.name] += 1
            return await self._call(target, body)

    async def _call(self, target: Target, body: Body) -> Sample:
        start = time.perf_counter()
        if target.prefill_url:
            body = {**body, "kv_transfer_params": await self._prefill(target.prefill_url, body)}
        elif target.kv_transfer_params:
            body = {**body, "kv_transfer_params": target.kv_transfer_params}
        if body.get("stream"):
            return await self._stream(target.url, body, start)
        return await self._whole(target.url, body, start)

    async def _prefill(self, url: str, body: Body) -> Body:
        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True,
                                                                               "do_remote_prefill": False}}
        reply = await self.http.post(url, json=leg)
        if reply.status_code != 200 or not reply.json().get("kv_transfer_params"):
            raise BenchError(f"prefill leg {url}: {reply.status_code} {reply.text[:200]}")
        return reply.json()["kv_transfer_params"]

    async def _whole(self, url: str, body: Body, start: float) -> Sample:
        reply = await self.http.post(url, json=body)
        end = time.perf_counter()
        if reply.status_code != 200 or reply.json()["choices"][0]["message"]["content"] != self.expected_text:
            raise BenchError(f"{url}: {reply.status_code} {reply.text[:300]}")
        return Sample(end - start, end - start)

    async def _stream(self, url: str, body: Body, start: float) -> Sample:
        parts: list[bytes] = []
        first = None
        async with self.http.stream("POST", url, json=body) as reply:
            async for chunk in reply.aiter_raw():
                first = first or time.perf_counter()
                parts.append(chunk)
        end = time.perf_counter()
        raw = b"".join(parts)
        if reply.status_code != 200 or not raw.endswith(b"data: [DONE]\n\n") or b"event: error" in raw:
            raise BenchError(f"{url}: {reply.status_code} {raw[-300:]!r}")
        return Sample((first or end) - start, end - start)


# ---- statistics -----------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of unsorted values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "mean_ms": statistics.fmean(ms), "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99), "min_ms": min(ms), "max_ms": max(ms)}


def compare(router: dict[str, float], direct: dict[str, float]) -> dict[str, float]:
    """What the router adds (ms) and router/direct ratios, per statistic."""
    out: dict[str, float] = {}
    for stat in ("mean", "p50", "p99"):
        r, d = router[f"{stat}_ms"], direct[f"{stat}_ms"]
        out[f"added_{stat}_ms"], out[f"ratio_{stat}"] = r - d, r / d
    return out


# ---- measurements ---------------------------------------------------------------------------------

def prompt_maker(words: int) -> Callable[[int, bool], Body]:
    """Chat bodies with a shared prefix of `words` words and a per-request suffix."""
    prefix = " ".join(FILLER[i % len(FILLER)] for i in range(words))

    def make(i: int, stream: bool) -> Body:
        body: Body = {"model": MODEL, "messages": [{"role": "user", "content": f"{prefix} (request {i})"}]}
        return {**body, "stream": True} if stream else body
    return make


async def throughput(client: Client, target: Target, make: Callable[[int, bool], Body], stream: bool,
                     concurrency: int, total: int) -> dict[str, float]:
    """`concurrency` clients, each sending total // concurrency requests back to back, after an
    untimed burst of `concurrency` requests (reopens connections an idle server closed)."""
    per_client = max(1, total // concurrency)
    totals: list[float] = []
    await asyncio.gather(*(client.call(target, make(c, stream)) for c in range(concurrency)))

    async def one_client(c: int) -> None:
        for j in range(per_client):
            totals.append((await client.call(target, make(c * per_client + j, stream))).total)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - start
    stats = summarize(totals)
    return {"requests": len(totals), "seconds": elapsed, "requests_per_s": len(totals) / elapsed,
            "mean_ms": stats["mean_ms"], "p99_ms": stats["p99_ms"]}


async def warm_up(client: Client, targets: list[Target], make: Callable[[int, bool], Body], args: argparse.Namespace
                  ) -> None:
    """Sequential requests of both kinds, then one burst at the highest concurrency (opens the pools)."""
    for target in targets:
        for stream in (False, True):
            for i in range(args.warmup):
                await client.call(target, make(i, stream))
            await asyncio.gather(*(client.call(target, make(i, stream)) for i in range(max(args.concurrency))))


def with_comparisons(latencies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for per_target in latencies.values():
        for baseline in [name for name in per_target if name.startswith("direct")]:
            per_target[f"router_vs_{baseline}"] = compare(per_target["router"], per_target[baseline])
    return latencies


def _pooled(rounds: list[dict[str, list[Sample]]], field: str) -> dict[str, dict[str, Any]]:
    """Per target: stats over every round's samples, plus the range of the per-round means."""
    out: dict[str, dict[str, Any]] = {}
    for name in rounds[0]:
        every = [getattr(x, field) for r in rounds for x in r[name]]
        means = [statistics.fmean(getattr(x, field) for x in r[name]) * 1000 for r in rounds]
        out[name] = {**summarize(every), "round_means_ms": [round(m, 4) for m in means]}
    return out


async def latency_round(client: Client, targets: list[Target], make: Callable[[int, bool], Body], stream: bool,
                        n: int, offset: int) -> dict[str, list[Sample]]:
    """n sequential requests per target, interleaved (rotating order) so drift hits all alike."""
    samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
    for i in range(offset, offset + n):
        for target in targets[i % len(targets):] + targets[:i % len(targets)]:
            samples[target.name].append(await client.call(target, make(i, stream)))
    return samples


async def measure_mode(targets: list[Target], args: argparse.Namespace, expected_text: str,
                       pids: dict[str, int]) -> tuple[dict, Counter]:
    """`args.rounds` rounds; each: latency of every target interleaved (plain, then stream), then
    requests/s of every target at each concurrency (order rotated per round), with the CPU the
    target's process tree used during that run, per request."""
    make = prompt_maker(args.prompt_words)
    pool = 4 * max(args.concurrency)
    # idle connections expire before any server's keep-alive timer closes them (uvicorn's: 5 s, httpx's
    # default expiry: also 5 s), so a reused connection is never one its server is closing (ReadError)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool, keepalive_expiry=2.0)
    tput_targets = [t for t in targets if t.prefill_url is None]
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0)) as http:
        client = Client(http, expected_text)
        await warm_up(client, targets, make, args)
        lat_rounds: dict[bool, list[dict[str, list[Sample]]]] = {False: [], True: []}
        tput: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
        for r in range(args.rounds):
            for stream in (False, True):
                lat_rounds[stream].append(await latency_round(client, targets, make, stream, args.requests,
                                                              r * args.requests))
            for kind, stream in (("chat", False), ("chat_stream", True)):
                for c in args.concurrency:
                    order = tput_targets[r % len(tput_targets):] + tput_targets[:r % len(tput_targets)]
                    for t in order:
                        before = proc_usage(pids[t.name]) if t.name in pids else None
                        row = await throughput(client, t, make, stream, c, args.throughput_requests)
                        if before is not None:
                            cpu, rss = proc_usage(pids[t.name])
                            row["cpu_us_per_request"] = (cpu - before[0]) / row["requests"] * 1e6
                            row["rss_mb"] = rss / 2**20
                        tput.setdefault(kind, {}).setdefault(str(c), {}).setdefault(t.name, []).append(row)
        lat: dict[str, dict[str, Any]] = {"chat": _pooled(lat_rounds[False], "total"),
                                          "chat_stream_ttfb": _pooled(lat_rounds[True], "ttfb"),
                                          "chat_stream_total": _pooled(lat_rounds[True], "total")}
        return {"latency": with_comparisons(lat), "throughput": tput,
                "reused_connection_retries": dict(client.retries)}, client.calls


# ---- legs check -----------------------------------------------------------------------------------

def stub_stats(url: str) -> Counter:
    return Counter(httpx.get(f"{url}/stats", timeout=5).json())


def check_legs(mode: str, prefill: Counter, decode: Counter, calls: Counter) -> dict[str, Any]:
    """The stubs' leg counters must match what this mode sends; else the numbers measure something else."""
    everything = sum(calls.values())
    if mode == "decode-only":
        expected = {"prefill_stub.prefill": 0, "decode_stub.local": everything, "decode_stub.decode": 0}
    else:                                   # every target but the direct decode call runs a prefill leg
        expected = {"prefill_stub.prefill": everything - calls["direct"],
                    "decode_stub.local": 0, "decode_stub.decode": everything}
    seen = {"prefill_stub.prefill": prefill["prefill"], "decode_stub.local": decode["local"],
            "decode_stub.decode": decode["decode"]}
    if seen != expected:
        raise BenchError(f"{mode}: the stubs saw legs {seen}, expected {expected} (requests per target: {calls})")
    return {"requests_per_target": dict(calls), "stub_legs": seen}


def targets_for(mode: str, router_url: str, prefill_url: str, decode_url: str) -> list[Target]:
    if mode == "decode-only":
        return [Target("direct", decode_url + CHAT), Target("router", router_url + CHAT)]
    prefill_leg = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}
    ktp = httpx.post(prefill_url + CHAT, json=prefill_leg, timeout=5).json()["kv_transfer_params"]
    return [Target("direct", decode_url + CHAT, kv_transfer_params=ktp), Target("router", router_url + CHAT),
            Target("direct_two_legs", decode_url + CHAT, prefill_url=prefill_url + CHAT)]


def run_mode(mode: str, model: Path, prefill_url: str, decode_url: str, args: argparse.Namespace,
             log_dir: Path, bin_dir: Path | None) -> dict[str, Any]:
    port = free_port()
    ports = {k: free_port()
             for k in ("nginx", "vllm-router", "vllm-router-prom", "sglang-router", "sglang-router-prom")}
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        pids = {"router": stack.enter_context(router(port, MODES[mode], prefill_url, decode_url, model, args,
                                                     log_dir)).pid}
        targets = targets_for(mode, f"http://127.0.0.1:{port}", prefill_url, decode_url)
        for peer in (peers_for(mode, prefill_url, decode_url, ports, log_dir, bin_dir) if args.peers else []):
            url = f"http://127.0.0.1:{ports[peer.name]}"
            try:
                proc = stack.enter_context(service(f"{peer.name}-{mode}", peer.args, url + peer.ready_path, log_dir,
                                                   args.startup_timeout, program=peer.program))
            except BenchError as exc:
                skipped[peer.name] = str(exc)[:500]
                continue
            pids[peer.name] = proc.pid
            targets.append(Target(peer.name, url + CHAT))
        before_p, before_d = stub_stats(prefill_url), stub_stats(decode_url)
        start = time.perf_counter()
        result, calls = asyncio.run(measure_mode(targets, args, "".join(token_text(i) for i in range(args.tokens)),
                                                 pids))
        legs = check_legs(mode, stub_stats(prefill_url) - before_p, stub_stats(decode_url) - before_d, calls)
    return {"router_disagg_threshold": MODES[mode], "seconds": time.perf_counter() - start,
            "peers_skipped": skipped, **legs, **result}


# ---- report ---------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    versions = {}
    for pkg in ("fastapi", "starlette", "uvicorn", "httpx", "h11", "uvloop", "httptools", "aiohttp", "orjson"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(), "packages": versions}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summary(modes: dict[str, Any]) -> dict[str, Any]:
    """Per mode and proxy: added latency over the direct call (decode-only) or over a client running
    both legs itself (P/D), as the median of per-round means with their range, the pooled p99;
    requests/s, router CPU per request and RSS per concurrency (median of rounds); and our router's
    figures as a ratio of each peer's."""
    out: dict[str, Any] = {}
    for mode, res in modes.items():
        lat, per_proxy = res["latency"], {}
        baseline = "direct" if mode == "decode-only" else "direct_two_legs"
        proxies = [n for n, v in lat["chat"].items() if "round_means_ms" in v and not n.startswith("direct")]
        for name in proxies:
            row: dict[str, Any] = {}
            for kind, per_target in lat.items():
                base = per_target[baseline] if baseline in per_target else per_target["direct"]
                added = [t - d for t, d in
                         zip(per_target[name]["round_means_ms"], base["round_means_ms"], strict=False)]
                row[kind] = {"added_mean_ms": round(_median(added), 3),
                             "added_mean_ms_range": [round(min(added), 3), round(max(added), 3)],
                             "added_p99_ms": round(per_target[name]["p99_ms"] - base["p99_ms"], 3)}
            for kind, per_c in res["throughput"].items():
                for c, per_target in per_c.items():
                    runs = per_target.get(name)
                    if not runs:
                        continue
                    rps = [r["requests_per_s"] for r in runs]
                    cell = {"requests_per_s": round(_median(rps), 1), "range": [round(min(rps), 1), round(max(rps), 1)],
                            "p99_ms": round(_median([r["p99_ms"] for r in runs]), 2)}
                    if "cpu_us_per_request" in runs[0]:
                        cpu = [r["cpu_us_per_request"] for r in runs]
                        cell["cpu_us_per_request"] = round(_median(cpu), 1)
                        cell["cpu_us_range"] = [round(min(cpu), 1), round(max(cpu), 1)]
                        cell["rss_mb"] = round(max(r["rss_mb"] for r in runs), 1)
                    row[f"{kind}_c{c}"] = cell
            per_proxy[name] = row
        direct_rps = {f"{k}_c{c}": round(_median([r["requests_per_s"] for r in per_t["direct"]]), 1)
                      for k, per_c in res["throughput"].items() for c, per_t in per_c.items() if "direct" in per_t}
        ours = per_proxy.get("router", {})
        ratios: dict[str, dict[str, float]] = {}
        for peer, row in per_proxy.items():
            if peer == "router":
                continue
            r: dict[str, float] = {}
            for key, cell in row.items():
                mine = ours.get(key, {})
                if "added_mean_ms" in cell and cell["added_mean_ms"] > 0:
                    r[f"{key}_added_mean"] = round(mine["added_mean_ms"] / cell["added_mean_ms"], 2)
                if "requests_per_s" in cell:
                    r[f"{key}_requests_per_s"] = round(mine["requests_per_s"] / cell["requests_per_s"], 2)
                if cell.get("cpu_us_per_request"):
                    r[f"{key}_cpu_per_request"] = round(mine["cpu_us_per_request"] / cell["cpu_us_per_request"], 2)
            ratios[f"router_vs_{peer}"] = r
        out[mode] = {"baseline": baseline, "proxies": per_proxy, "direct_requests_per_s": direct_rps,
                     "ratios": ratios, "peers_skipped": list(res.get("peers_skipped", {}))}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100, help="latency samples per target, kind and round")
    p.add_argument("--throughput-requests", type=int, default=320, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="concurrent clients")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per request (stub)")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="stub time per token")
    p.add_argument("--prompt-words", type=int, default=200, help="words in each prompt")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests per target and kind")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each: latency, then requests/s)")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip nginx, vllm-router and sglang-router (else: started side by side with ours)")
    p.add_argument("--model", type=Path, help="checkpoint dir for the router's tokenizer (default: a tiny one)")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if min(args.requests, args.throughput_requests, args.rounds, *args.concurrency) < 1 or args.warmup < 0:
        p.error("--requests, --throughput-requests and --concurrency must be >= 1, --warmup >= 0")
    return args


def _tiny_checkpoint(tmp: Path) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return Path(create_checkpoint("tiny", tmp / "tiny", progress=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    start, machine_before = time.perf_counter(), machine_info()
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        tmp_dir = Path(tmp)
        model = args.model or _tiny_checkpoint(tmp_dir)
        prefill_port, decode_port = free_port(), free_port()
        prefill_url, decode_url = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
        bin_dir = ensure_venv() if args.peers else None
        with stub_worker("prefill", prefill_port, args, tmp_dir), stub_worker("decode", decode_port, args, tmp_dir):
            modes = {}
            for mode in args.modes:
                print(f"router_overhead: measuring {mode} ...", file=sys.stderr, flush=True)
                modes[mode] = run_mode(mode, model, prefill_url, decode_url, args, tmp_dir, bin_dir)
    config = {k: v for k, v in vars(args).items() if k not in ("model", "output")}
    machine = {**machine_before, "load_average_at_end": machine_info()["load_average_1_5_15"]}
    return {"benchmark": "router_overhead", "machine": machine, "config": config,
            "summary": summary(modes), "modes": modes, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the cleanup (stop the servers) on SIGTERM
    result = run(args)
    text = json.dumps(result, indent=2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
