"""What one load view across router replicas costs (router/registry.py `_share_load`): static workers
report to no store, so each replica writes what it sent them and reads the others' once per refresh.

Run: `python -m benchmarks.shared_load_view [--workers 8 64] [--routers 2 4] [--rounds 200]`.

Per (N static workers, R replicas) against an embedded Valkey on loopback: the seconds one replica's
refresh takes (the share is its only store call for a static fleet: one pipelined round trip), the
bytes it writes, and what a placement pays for it: `WorkerRegistry.states()` (built once per request)
with the other replicas' figures added against without. The request path makes no store call: the
view is as old as one refresh interval (0.5 s by default). JSON to benchmarks/results/shared_load_view.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import msgpack

from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.store.embedded import EmbeddedValkey
from shared.store.redis_store import RedisStore

RESULTS = Path(__file__).resolve().parent / "results" / "shared_load_view.json"


def settings(n: int, url: str, namespace: str) -> RouterSettings:
    urls = tuple(f"http://10.0.{i // 250}.{i % 250 + 1}:8200" for i in range(n))
    return RouterSettings(model=None, static_decode=urls, store_url=url, namespace=namespace,
                          static_cache_tokens=1 << 20)


def per_call_us(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


async def one(url: str, n: int, r: int, rounds: int) -> dict:
    namespace = f"bench-{n}-{r}-{os.getpid()}"
    stores = [RedisStore(url, namespace) for _ in range(r)]
    registries = [WorkerRegistry(settings(n, url, namespace), store) for store in stores]
    for reg in registries:                            # every replica has work open on every worker
        for wid in reg.static:
            reg.begin(wid)
            reg.ledger.open(wid, 2048)
        await reg.refresh()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        await registries[0].refresh()
        times.append(time.perf_counter() - start)
    reg = registries[0]
    shared_us = per_call_us(reg.states, rounds)
    peers, reg.peers = reg.peers, {}
    alone_us = per_call_us(reg.states, rounds)
    reg.peers = peers
    mine = {wid: [1, 0.1024] for wid in reg.static}
    for store in stores:
        await store.close()
    return {"workers": n, "routers": r, "refresh_ms_p50": round(statistics.median(times) * 1e3, 3),
            "refresh_ms_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e3, 3),
            "entry_bytes": len(msgpack.packb({"at": time.time(), "loads": mine})),
            "states_us_shared": round(shared_us, 1), "states_us_alone": round(alone_us, 1),
            "placement_extra_us": round(shared_us - alone_us, 1), "store_calls_per_request": 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    p.add_argument("--routers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    rows = []
    with EmbeddedValkey() as server:
        for n in args.workers:
            for r in args.routers:
                rows.append(asyncio.run(one(server.url, n, r, args.rounds)))
                print(json.dumps(rows[-1]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
