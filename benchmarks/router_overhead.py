"""Latency and throughput the router adds in front of model-free stub workers.

Run: `python -m benchmarks.router_overhead [--requests 200] [--concurrency 1 8 32] [--tokens 16]`.

Starts one prefill and one decode stub worker (benchmarks.stub_worker) and the real router
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
import socket
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

from benchmarks.stub_worker import token_text

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

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def service(name: str, args: list[str], ready_url: str, log_dir: Path, timeout_s: float) -> Iterator[None]:
    """Run `python <args>` from the repository root until the block ends; ready when ready_url is 200."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        # no threads run here (asyncio.run joins its executor before returning), so preexec_fn is safe
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: PLW1509
    try:
        _wait_ready(proc, ready_url, timeout_s, log)
        yield
    finally:
        _stop(proc)


def stub_worker(role: str, port: int, args: argparse.Namespace, log_dir: Path):
    cmd = ["-m", "benchmarks.stub_worker", "--port", str(port), "--role", role, "--tokens", str(args.tokens),
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
        self.http, self.expected_text, self.calls = http, expected_text, Counter()

    async def call(self, target: Target, body: Body) -> Sample:
        self.calls[target.name] += 1
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


async def latency(client: Client, targets: list[Target], make: Callable[[int, bool], Body], stream: bool,
                  n: int) -> dict[str, dict[str, Any]]:
    """n sequential requests per target, interleaved (rotating order) so drift hits all alike."""
    samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
    for i in range(n):
        for target in targets[i % len(targets):] + targets[:i % len(targets)]:
            samples[target.name].append(await client.call(target, make(i, stream)))
    kinds = {"chat_stream_ttfb": "ttfb", "chat_stream_total": "total"} if stream else {"chat": "total"}
    return {kind: {name: summarize([getattr(s, field) for s in got]) for name, got in samples.items()}
            for kind, field in kinds.items()}


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


async def measure_mode(targets: list[Target], args: argparse.Namespace, expected_text: str) -> tuple[dict, Counter]:
    make = prompt_maker(args.prompt_words)
    pool = 4 * max(args.concurrency)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0)) as http:
        client = Client(http, expected_text)
        await warm_up(client, targets, make, args)
        lat: dict[str, dict[str, Any]] = {}
        for stream in (False, True):
            lat.update(await latency(client, targets, make, stream, args.requests))
        tput: dict[str, dict[str, Any]] = {}
        for kind, stream in (("chat", False), ("chat_stream", True)):
            for c in args.concurrency:
                row = {t.name: await throughput(client, t, make, stream, c, args.throughput_requests)
                       for t in targets[:2]}                     # direct and router
                row["ratio_router_vs_direct"] = row["router"]["requests_per_s"] / row["direct"]["requests_per_s"]
                tput.setdefault(kind, {})[str(c)] = row
        return {"latency": with_comparisons(lat), "throughput": tput}, client.calls


# ---- legs check -----------------------------------------------------------------------------------

def stub_stats(url: str) -> Counter:
    return Counter(httpx.get(f"{url}/stats", timeout=5).json())


def check_legs(mode: str, prefill: Counter, decode: Counter, calls: Counter) -> dict[str, Any]:
    """The stubs' leg counters must match what this mode sends; else the numbers measure something else."""
    everything = sum(calls.values())
    if mode == "decode-only":
        expected = {"prefill_stub.prefill": 0, "decode_stub.local": everything, "decode_stub.decode": 0}
    else:
        expected = {"prefill_stub.prefill": calls["router"] + calls["direct_two_legs"],
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
             log_dir: Path) -> dict[str, Any]:
    port = free_port()
    with router(port, MODES[mode], prefill_url, decode_url, model, args, log_dir):
        targets = targets_for(mode, f"http://127.0.0.1:{port}", prefill_url, decode_url)
        before_p, before_d = stub_stats(prefill_url), stub_stats(decode_url)
        start = time.perf_counter()
        result, calls = asyncio.run(measure_mode(targets, args, "".join(token_text(i) for i in range(args.tokens))))
        legs = check_legs(mode, stub_stats(prefill_url) - before_p, stub_stats(decode_url) - before_d, calls)
    return {"router_disagg_threshold": MODES[mode], "seconds": time.perf_counter() - start, **legs, **result}


# ---- report ---------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    versions = {}
    for pkg in ("fastapi", "starlette", "uvicorn", "httpx", "h11", "uvloop", "httptools"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(), "packages": versions}


def summary(modes: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers: router added latency vs the decode stub, ratios, requests/s."""
    out: dict[str, Any] = {}
    for mode, res in modes.items():
        row: dict[str, Any] = {}
        for kind, per_target in res["latency"].items():
            for baseline in ("direct", "direct_two_legs"):
                if f"router_vs_{baseline}" in per_target:
                    cmp = per_target[f"router_vs_{baseline}"]
                    suffix = "" if baseline == "direct" else "_vs_two_legs"
                    row[f"{kind}{suffix}"] = {k: round(cmp[k], 3) for k in
                                              ("added_mean_ms", "added_p99_ms", "ratio_mean", "ratio_p99")}
        for kind, per_c in res["throughput"].items():
            row[f"{kind}_requests_per_s"] = {c: {"direct": round(r["direct"]["requests_per_s"], 1),
                                                 "router": round(r["router"]["requests_per_s"], 1),
                                                 "ratio": round(r["ratio_router_vs_direct"], 3)}
                                             for c, r in per_c.items()}
        out[mode] = row
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="latency samples per target and kind")
    p.add_argument("--throughput-requests", type=int, default=320, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per request (stub)")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="stub time per token")
    p.add_argument("--prompt-words", type=int, default=200, help="words in each prompt")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests per target and kind")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--model", type=Path, help="checkpoint dir for the router's tokenizer (default: a tiny one)")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if min(args.requests, args.throughput_requests, *args.concurrency) < 1 or args.warmup < 0:
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
        with stub_worker("prefill", prefill_port, args, tmp_dir), stub_worker("decode", decode_port, args, tmp_dir):
            modes = {}
            for mode in args.modes:
                print(f"router_overhead: measuring {mode} ...", file=sys.stderr, flush=True)
                modes[mode] = run_mode(mode, model, prefill_url, decode_url, args, tmp_dir)
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
