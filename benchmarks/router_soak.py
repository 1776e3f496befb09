"""Router RSS over a soak: a `kimi-pd router` process in front of stub workers (P/D and decode-only,
streamed and whole, fan-outs, a fresh prompt and client id every request), its RSS sampled as it goes.

The issue saw RSS rise 14 % over a 10-minute soak and still rising. What grew (tracemalloc, diffed
over thousands of requests) were per-worker structures that are bounded but were large: the begin/end
events of workers that never report load (up to 65,536 each, now 8,192 or 60 s), the approximate prefix
index of workers whose cache size is unknown (65,536 blocks), and the hash-chain memo (16,384 links).
The RSS should flatten once they are full. `tests/router/test_soak_bounded.py` checks the sizes.

    python -m benchmarks.router_soak [--minutes 3] [--concurrency 8]     # results/router_soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.peers import proc_usage
from benchmarks.procs import spawn, wait_ok
from shared.net import free_port

RESULTS = Path(__file__).parent / "results"


def _start(cmd: list[str]) -> subprocess.Popen:
    return spawn(cmd, {**os.environ, "KIMI_PD_ADMIN_TOKEN": "soak-admin-token"})


def _body(i: int) -> tuple[str, dict]:
    text = f"soak request {i} " * (4 + i % 16)
    if i % 4 == 3:
        return "/v1/completions", {"model": "kimi-k3", "prompt": [text, text + "!"], "max_tokens": 2}
    return "/v1/chat/completions", {"model": "kimi-k3", "messages": [{"role": "user", "content": text}],
                                    "max_tokens": 3, "request_id": f"client-{i}", "stream": i % 2 == 0}


async def _drive(url: str, seconds: float, concurrency: int, pid: int, samples: list[dict]) -> dict[int, int]:
    statuses: dict[int, int] = {}
    counter = iter(range(10**9))
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def sample() -> None:
            while time.monotonic() - start < seconds:
                samples.append({"t_s": round(time.monotonic() - start, 1), "requests": sum(statuses.values()),
                                "rss_mib": round(proc_usage(pid)[1] / 2**20, 1)})
                await asyncio.sleep(5)

        async def worker() -> None:
            while time.monotonic() - start < seconds:
                path, body = _body(next(counter))
                reply = await client.post(path, json=body)
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
        await asyncio.gather(sample(), *(worker() for _ in range(concurrency)))
    samples.append({"t_s": round(time.monotonic() - start, 1), "requests": sum(statuses.values()),
                    "rss_mib": round(proc_usage(pid)[1] / 2**20, 1)})
    return statuses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "router_soak.json"))
    config = p.parse_args(argv)
    ports = {name: free_port() for name in ("prefill", "decode", "router")}
    procs = [_start([sys.executable, "-m", "tests.stub_worker", "--port", str(ports[role]), "--role", role,
                     "--tokens", "3"]) for role in ("prefill", "decode")]
    url = f"http://127.0.0.1:{ports['router']}"
    try:
        for role in ("prefill", "decode"):
            wait_ok(f"http://127.0.0.1:{ports[role]}/health", 120, 0.2)
        router = _start([sys.executable, "-m", "kimi_pd", "router", "--workers", "1", "--port", str(ports["router"]),
                         "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                         "--decode", f"http://127.0.0.1:{ports['decode']}", "--disagg-threshold", "40",
                         "--log-level", "error"])
        procs.append(router)
        wait_ok(url + "/ready", 120, 0.2)
        samples: list[dict] = []
        statuses = asyncio.run(_drive(url, config.minutes * 60, config.concurrency, router.pid, samples))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    third = len(samples) // 3
    report = {"config": vars(config), "statuses": statuses, "samples": samples,
              "rss_mib": {"start": samples[0]["rss_mib"], "middle": samples[len(samples) // 2]["rss_mib"],
                          "end": samples[-1]["rss_mib"]},
              "last_third_growth_mib": round(samples[-1]["rss_mib"] - samples[2 * third]["rss_mib"], 1),
              "load_average": os.getloadavg()}
    Path(config.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{samples[-1]['requests']} requests {statuses}; router RSS MiB start/middle/end {report['rss_mib']}, "
          f"last third {report['last_third_growth_mib']:+} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
