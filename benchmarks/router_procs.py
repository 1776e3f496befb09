"""What `kimi-pd router --workers N` costs and buys (docs/router-processes.md).

Run: `python -m benchmarks.router_procs [--seconds 6] [--rounds 2] [--concurrency 16]` (about 2 minutes).

1. sharing placement state per request, in one process: begin + ledger open + a prefix send + the
   sibling's `states()` + end + settle through the mmap'd table, against the same without sharing, and
   against what a store round trip per request would cost (the store's shared load view, embedded
   Valkey on loopback: it is refreshed once per interval, so a per-request view would pay this each time);
2. following the store's KV events: one `registry.refresh()` over 16 workers with new event batches,
   what each router process pays per refresh interval when every process follows the events itself;
3. end to end: two routers over the same two stub decode workers (separate processes), `--workers 1` and
   `--workers 2`, driven alternately (A, B, A, B) by one closed-loop client: requests/s and the ratio.

Writes benchmarks/results/router_procs.json and benchmarks/results/router_procs.md, with the load average at
start and end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from router.procs.share import ProcessShare
from router.procs.table import SharedTable
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.kv_events import BlockStored, KVEventBatch
from shared.net import free_port
from shared.workers import WorkerInfo

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def static_workers(n: int) -> tuple[str, ...]:
    return tuple(f"http://10.0.{i // 250}.{i % 250 + 1}:8200" for i in range(n))


STATIC = static_workers(8)


def sharing_registries(table: SharedTable, settings: RouterSettings) -> list[WorkerRegistry]:
    """One registry per process of `table`, each attached as that process and knowing every worker."""
    regs = [WorkerRegistry(settings, None) for _ in range(table.nprocs)]
    for i, reg in enumerate(regs):
        ProcessShare(table, i).attach(reg)
        reg.share.know(reg.all_infos())             # type: ignore[union-attr]
    return regs


def per_request_us(a: WorkerRegistry, b: WorkerRegistry, rounds: int) -> float:
    hashes = list(range(1, 33))
    start = time.perf_counter()
    for i in range(rounds):
        wid = STATIC[i % len(STATIC)]
        a.begin(wid)
        leg = a.ledger.open(wid, 512)
        a.index.record_sent(wid, hashes)
        b.states()
        a.end(wid, ok=True)
        a.ledger.settle(leg)
    return (time.perf_counter() - start) / rounds * 1e6


def table_costs(rounds: int) -> dict:
    settings = RouterSettings(model=None, static_decode=STATIC, static_cache_tokens=1 << 20)
    plain = [WorkerRegistry(settings, None) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        table = SharedTable.create(os.path.join(tmp, "t"), 2, threading.Lock())
        shared = sharing_registries(table, settings)
        alone, with_table = [], []
        for _ in range(5):                               # interleaved
            alone.append(per_request_us(*plain, rounds))
            with_table.append(per_request_us(*shared, rounds))
        table.close()
    a, t = statistics.median(alone), statistics.median(with_table)
    return {"static_workers": len(STATIC), "request_us_alone": round(a, 1), "request_us_shared": round(t, 1),
            "shared_extra_us": round(t - a, 1)}


def sibling_sends_us(nprocs: int, rounds: int, workers: int = len(STATIC)) -> dict:
    """What one process's placement read (`states()`) costs when each of its `nprocs - 1` siblings has
    served one request since its last read (the steady state of N busy processes): it replays their
    sends into its prefix index and adds up their load cells, for each of `workers` static workers.
    Against the same read in a process with no siblings. Only the reader's `states()` is timed; the
    siblings' own work is theirs."""
    static = static_workers(workers)
    settings = RouterSettings(model=None, static_decode=static, static_cache_tokens=1 << 20)
    head = list(range(1, 25))                           # prompts share 24 blocks and end in 8 of their own
    alone = WorkerRegistry(settings, None)
    with tempfile.TemporaryDirectory() as tmp:
        table = SharedTable.create(os.path.join(tmp, "t"), nprocs, threading.Lock())
        reader, *siblings = sharing_registries(table, settings)
        shared_s = alone_s = 0.0
        for i in range(rounds):
            wid = static[i % len(static)]
            for k, sib in enumerate(siblings):
                sib.begin(wid)
                leg = sib.ledger.open(wid, 512)
                tail = 10**6 + (i * nprocs + k) * 8
                sib.index.record_sent(wid, head + list(range(tail, tail + 8)))
                sib.end(wid, ok=True)
                sib.ledger.settle(leg)
            start = time.perf_counter()
            reader.states()
            shared_s += time.perf_counter() - start
            start = time.perf_counter()
            alone.states()
            alone_s += time.perf_counter() - start
        table.close()
    shared_us, alone_us = shared_s / rounds * 1e6, alone_s / rounds * 1e6
    return {"procs": nprocs, "workers": workers, "states_us_shared": round(shared_us, 1),
            "states_us_alone": round(alone_us, 1),
            "extra_us_per_request": round(shared_us - alone_us, 1)}


async def store_costs(url: str, rounds: int) -> dict:
    from shared.store.redis_store import RedisStore
    store = RedisStore(url, f"procs-{os.getpid()}")
    mine = {wid: [1, 0.25] for wid in STATIC}
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        await store.share_router_load(f"r{i % 2}", mine, 2.0)
        times.append(time.perf_counter() - start)
    for i in range(16):
        info = WorkerInfo(worker_id=f"w{i}", role="decode", url=f"http://10.0.1.{i}:8200", model_id="kimi-k3")
        await store.register(info, 60.0)
        await store.write_kv_snapshot(info.worker_id, 0, list(range(i * 1000, i * 1000 + 512)))
    reg = WorkerRegistry(RouterSettings(model=None, store_url=url), store)
    await reg.refresh()
    refresh = []
    for r in range(rounds // 4):
        for i in range(16):                          # one batch of 4 new blocks per worker per interval
            await store.publish_kv_events(f"w{i}", KVEventBatch(time.time(), [BlockStored(
                [r * 4 + k + 10 ** 6 for k in range(4)], None, [], 16)]))
        start = time.perf_counter()
        await reg.refresh()
        refresh.append(time.perf_counter() - start)
    await store.close()
    return {"store_view_round_trip_us_p50": round(statistics.median(times) * 1e6, 1),
            "refresh_16_workers_ms_p50": round(statistics.median(refresh) * 1e3, 2)}


def start_router(workers: int, decode: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "kimi_pd", "router", "--no-tokenizer", "--port", str(port), "--workers",
            str(workers), "--health-check-interval", "5", "--log-level", "warning"]
    for url in decode:
        argv += ["--decode", url]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready")


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (the router's processes under --workers N)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


async def drive(url: str, seconds: float, concurrency: int) -> float:
    body = {"model": "kimi-k3", "prompt": "hello there, how are you", "max_tokens": 4}
    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                resp = await client.post("/v1/completions", json=body)
                done += resp.status_code == 200
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


def end_to_end(seconds: float, rounds: int, concurrency: int, tmp: Path) -> dict:
    procs, decode = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.stub_worker", "--port", str(port), "--role",
                                           "decode", "--tokens", "4"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)}))
            decode.append(f"http://127.0.0.1:{port}")
        routers = {n: start_router(n, decode, tmp / f"router{n}.log") for n in (1, 2)}
        procs += [p for p, _ in routers.values()]
        for _, url in routers.values():
            wait_ready(url)
        time.sleep(3.0)                                  # the second process of --workers 2 is up too
        rates: dict[int, list[float]] = {1: [], 2: []}
        cpu_ms: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(rounds):
            for n, (proc, url) in routers.items():
                before = cpu_s(proc.pid)
                rate = asyncio.run(drive(url, seconds, concurrency))
                rates[n].append(rate)
                cpu_ms[n].append((cpu_s(proc.pid) - before) * 1e3 / max(rate * seconds, 1))
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        return {"rps_workers_1": [round(r, 1) for r in rates[1]], "rps_workers_2": [round(r, 1) for r in rates[2]],
                "ratio_2_over_1": round(two / one, 3), "concurrency": concurrency, "seconds_each": seconds,
                "router_cpu_ms_per_request_1": [round(c, 2) for c in cpu_ms[1]],
                "router_cpu_ms_per_request_2": [round(c, 2) for c in cpu_ms[2]]}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--micro-rounds", type=int, default=2000)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8, 16],
                   help="process counts for the sibling-sends sweep")
    p.add_argument("--sweep-workers", type=int, nargs="+", default=[8, 64],
                   help="static worker counts for the sibling-sends sweep (each sibling's cells are read per worker)")
    args = p.parse_args(argv)
    out: dict = {"loadavg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    out["table"] = table_costs(args.micro_rounds)
    print(json.dumps(out["table"]), flush=True)
    out["sibling_sends"] = [sibling_sends_us(n, args.micro_rounds, w) for w in args.sweep_workers for n in args.procs]
    print(json.dumps(out["sibling_sends"]), flush=True)
    from shared.store.embedded import EmbeddedValkey
    with EmbeddedValkey() as server:
        out["store"] = asyncio.run(store_costs(server.url, 400))
    print(json.dumps(out["store"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out["end_to_end"] = end_to_end(args.seconds, args.rounds, args.concurrency, Path(tmp))
    print(json.dumps(out["end_to_end"]), flush=True)
    out["loadavg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = RESULTS / "router_procs.json"
    result.write_text(json.dumps(out, indent=1) + "\n")
    result.with_suffix(".md").write_text(report(out))          # benchmarks/results/router_procs.md
    return 0


def report(out: dict) -> str:
    t, s, e = out["table"], out["store"], out["end_to_end"]
    la0, la1 = (" ".join(f"{x:.1f}" for x in out[k]) for k in ("loadavg_start", "loadavg_end"))
    rows = [
        (f"one request's sharing through the table ({t['static_workers']} static workers: begin, open, send, "
         "the sibling's states(), end, settle)",
         f"{t['request_us_shared']} us vs {t['request_us_alone']} us unshared (+{t['shared_extra_us']} us)"),
        ("one store round trip of the shared load view (what a per-request store view would pay)",
         f"{s['store_view_round_trip_us_p50']} us p50"),
        ("one registry refresh following KV events of 16 workers (per process, per refresh interval)",
         f"{s['refresh_16_workers_ms_p50']} ms p50"),
        (f"end to end, small completions, {e['concurrency']} clients, {e['seconds_each']} s each, interleaved",
         f"--workers 1: {e['rps_workers_1']} req/s; --workers 2: {e['rps_workers_2']} req/s; "
         f"ratio {e['ratio_2_over_1']}"),
        ("router CPU per request (all its processes)",
         f"--workers 1: {e['router_cpu_ms_per_request_1']} ms; --workers 2: {e['router_cpu_ms_per_request_2']} ms")]
    rows += [(f"one placement read in one of {n['procs']} busy processes over {n['workers']} workers "
              f"(replaying {n['procs'] - 1} sibling sends, adding their load)",
              f"{n['states_us_shared']} us vs {n['states_us_alone']} us alone (+{n['extra_us_per_request']} us per "
              "request)") for n in out["sibling_sends"]]
    table = "\n".join(f"| {what} | {figure} |" for what, figure in rows)
    return f"""# router_procs: `kimi-pd router --workers N`

`python -m benchmarks.router_procs` on {out["cores"]} cores, load average {la0} at start, {la1} at end.

| what | figure |
|---|---|
{table}

The end-to-end client, the two stub workers and both routers share the same cores: on a small host the
ratio measures contention as much as the router; on a quiet host with spare cores it is the figure to read.
"""


if __name__ == "__main__":
    raise SystemExit(main())
