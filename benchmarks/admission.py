"""A flood from one tenant against another tenant's TTFT, with and without admission control, same run.

The fleet is a stub worker with a fixed number of slots (`--max-running`: an engine's batch; the rest
wait FIFO, as in an engine's queue) behind one router. A "victim" tenant sends one streamed request
every `--victim-interval` s; a "flood" tenant runs `--flood-clients` loops sending back to back (a
client that gets a 429 or 503 waits `--backoff` s, as OpenAI's clients back off). Three phases:

  alone: the victim only (its TTFT with an idle fleet);
  off:   victim + flood through a router without admission control;
  on:    victim + flood through a router with `--tenants` (flood: `--flood-rpm`, class 1; victim:
         class 0) and `--max-inflight-per-worker` equal to the worker's slots.

Goal: with admission on, the victim's p99 TTFT is at most `GOAL_FACTOR` x its p99 alone. Also reports
the cost of the store's rate-limit call per request (router metric and a direct loop).

Run: python -m benchmarks.admission [--seconds 15] [--flood-clients 24]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.procs import spawn, wait_ok
from shared.net import free_port
from shared.store import RedisStore
from shared.store.buckets import BucketSpec
from shared.store.embedded import EmbeddedValkey

RESULTS = Path(__file__).parent / "results" / "admission.json"
GOAL_FACTOR = 2.0
TENANTS = """
[tenants.victim]
keys = ["sk-victim-bench-01"]
priority = 0
[tenants.flood]
keys = ["sk-flood-bench-001"]
rpm = {rpm}
priority = 1
"""
BODY = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_ttft(client: httpx.AsyncClient, url: str, key: str) -> tuple[int, float | None]:
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=BODY,
                             headers={"authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, None
        ttft = None
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                ttft = time.perf_counter() - start
        return 200, ttft


async def phase(url: str, seconds: float, flood_clients: int, interval: float, backoff: float) -> dict:
    stop = time.monotonic() + seconds
    victim: list[float] = []
    flood = {"ok": 0, "429": 0, "503": 0, "other": 0}
    limits = httpx.Limits(max_connections=flood_clients + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def flooder() -> None:
            while time.monotonic() < stop:
                code, _ = await stream_ttft(client, url, "sk-flood-bench-001")
                flood["ok" if code == 200 else str(code) if str(code) in flood else "other"] += 1
                if code != 200:
                    await asyncio.sleep(backoff)

        async def one_victim() -> None:
            code, ttft = await stream_ttft(client, url, "sk-victim-bench-01")
            if code == 200 and ttft is not None:
                victim.append(ttft)

        floods = [asyncio.create_task(flooder()) for _ in range(flood_clients)]
        await asyncio.sleep(1.0 if flood_clients else 0)          # the flood is on before the victim starts
        victims = []
        while time.monotonic() < stop:
            victims.append(asyncio.create_task(one_victim()))
            await asyncio.sleep(interval)
        await asyncio.gather(*victims, *floods)
    return {"victim_requests": len(victim), "victim_ttft_p50_s": pct(victim, 0.5),
            "victim_ttft_p90_s": pct(victim, 0.9),
            "victim_ttft_p99_s": pct(victim, 0.99),
            "victim_ttft_max_s": max(victim) if victim else None, "flood": flood,
            "flood_served_per_s": round(flood["ok"] / seconds, 2)}


def router_argv(port: int, stub: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "kimi_pd", "router", "--workers", "1", "--no-tokenizer", "--port", str(port),
            "--worker", stub, "--log-level", "warning", *extra]


def store_cost_ms(metrics_text: str) -> float | None:
    values = {}
    for line in metrics_text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith("kimi_pd_router_ratelimit_store_seconds" + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return 1000 * values["_sum"] / values["_count"] if values.get("_count") else None


async def direct_store_cost(url: str, n: int = 500) -> dict:
    store = RedisStore(url, namespace=uuid.uuid4().hex)
    specs = [BucketSpec("t:requests", 1e9, 1e7, 1), BucketSpec("t:tokens", 1e9, 1e7, 100)]
    try:
        await store.take_buckets(specs)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await store.take_buckets(specs)
            times.append(1000 * (time.perf_counter() - start))
        return {"calls": n, "mean_ms": round(statistics.mean(times), 3), "p99_ms": round(pct(times, 0.99) or 0, 3)}
    finally:
        await store.close()


def run(args: argparse.Namespace, tmp: Path) -> dict:
    env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": "bench-admin-token", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    store = EmbeddedValkey()
    store.start()
    try:
        stub_port = free_port()
        procs.append(spawn([sys.executable, "-m", "tests.stub_worker", "--port", str(stub_port), "--role", "both",
                            "--tokens", "8", "--token-delay-ms", str(args.token_delay_ms), "--first-token-delay-ms",
                            str(args.first_token_delay_ms), "--max-running", str(args.slots)], env, tmp / "stub.log"))
        stub = f"http://127.0.0.1:{stub_port}"
        (tmp / "tenants.toml").write_text(TENANTS.format(rpm=args.flood_rpm))
        ports = {"off": free_port(), "on": free_port()}
        on_flags = ["--redis-url", store.url, "--tenants", str(tmp / "tenants.toml"),
                    "--max-inflight-per-worker", str(args.slots), "--queue-timeout", "30"]
        # "off" still needs to accept both keys: the same key list, without limits, classes or a queue
        env_off = {**env, "KIMI_PD_API_KEYS": "sk-victim-bench-01,sk-flood-bench-001"}
        procs.append(spawn(router_argv(ports["off"], stub, []), env_off, tmp / "router-off.log"))
        procs.append(spawn(router_argv(ports["on"], stub, on_flags), env, tmp / "router-on.log"))
        urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
        for url in urls.values():
            wait_ok(url + "/ready", 60)
        result: dict = {}
        result["alone"] = asyncio.run(phase(urls["off"], args.seconds, 0, args.victim_interval, args.backoff))
        for mode in ("off", "on"):
            result[mode] = asyncio.run(phase(urls[mode], args.seconds, args.flood_clients, args.victim_interval,
                                             args.backoff))
            time.sleep(1.0)
        metrics = httpx.get(urls["on"] + "/metrics", timeout=5).text
        result["store_cost"] = {"router_mean_ms": store_cost_ms(metrics),
                                "direct": asyncio.run(direct_store_cost(store.url))}
        return result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        store.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=15.0, help="per phase")
    p.add_argument("--flood-clients", type=int, default=24)
    p.add_argument("--flood-rpm", type=int, default=120, help="the flood tenant's limit with admission on")
    p.add_argument("--slots", type=int, default=4, help="the worker's requests generating at once")
    p.add_argument("--token-delay-ms", type=float, default=10.0)
    p.add_argument("--first-token-delay-ms", type=float, default=50.0)
    p.add_argument("--victim-interval", type=float, default=0.25)
    p.add_argument("--backoff", type=float, default=0.5, help="a flood client's wait after a 429/503")
    args = p.parse_args(argv)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    alone, on, off = (result[k]["victim_ttft_p99_s"] for k in ("alone", "on", "off"))
    result["config"] = vars(args)
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    result["ratios"] = {"on_vs_alone": round(on / alone, 2) if on and alone else None,
                        "off_vs_alone": round(off / alone, 2) if off and alone else None}
    result["goal"] = {"factor": GOAL_FACTOR, "met": bool(on and alone and on <= GOAL_FACTOR * alone)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ratios", "goal", "store_cost")}, indent=2))
    for k in ("alone", "off", "on"):
        print(k, json.dumps(result[k]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
