"""Fairness inside a worker: another client's latency while one request's fan-out (a prompt list x n) runs.

A router in front of one colocated worker (`--max-num-seqs 8`) serving the shipped tiny-chat model. One
client sends a completions request of P prompts x n sequences; once it is running, another client
sends short chat requests one after another until the fan-out ends, and times them. The same run is
made with the worker's `--request-share` at 0.5 (the default: one fan-out holds half the batch while
another request waits) and at 1.0 (no share: first come, first served), against the other client's
latency on an idle worker.

    python -m benchmarks.fairness [--prompts 64] [--n 4] [--shares 0.5 1.0]     # results/fairness.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.procs import spawn, wait_ok
from shared.net import free_port

RESULTS = Path(__file__).parent / "results"
MODEL = Path(__file__).parent.parent / "engine" / "presets_data" / "tiny-chat"
OTHER = {"model": "kimi-k3", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
         "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"thinking": False}}


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "kimi_pd", *args], {**os.environ, "OMP_NUM_THREADS": "1"}, log)


def _other_latency(url: str) -> float:
    t0 = time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", json=OTHER, timeout=600.0)
    resp.raise_for_status()
    return time.perf_counter() - t0


def _fan_out_body(prompts: int, n: int, max_tokens: int) -> dict[str, Any]:
    return {"model": "kimi-k3", "prompt": [f"Count from {i} to {i + 20}:" for i in range(prompts)], "n": n,
            "max_tokens": max_tokens, "temperature": 0.7, "seed": 1, "ignore_eos": True}


def one_share(share: float, config: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The other client's latency alone, then during the fan-out, on a fresh worker with this share."""
    wport, rport = free_port(), free_port()
    worker = _start(["worker", "--model", str(MODEL), "--port", str(wport), "--max-num-seqs", "8",
                     "--request-share", str(share)], workdir / f"worker-{share}.log")
    router = _start(["router", "--workers", "1", "--port", str(rport), "--worker", f"http://127.0.0.1:{wport}"],
                    workdir / f"router-{share}.log")
    url = f"http://127.0.0.1:{rport}"
    try:
        wait_ok(f"http://127.0.0.1:{wport}/health", 180)
        wait_ok(url + "/ready", 180)
        alone = [_other_latency(url) for _ in range(config.rounds)]
        big: dict[str, Any] = {}

        def send_big() -> None:
            t0 = time.perf_counter()
            resp = httpx.post(url + "/v1/completions", json=_fan_out_body(config.prompts, config.n, config.max_tokens),
                              timeout=1800.0)
            big.update(status=resp.status_code, seconds=time.perf_counter() - t0,
                       choices=len(resp.json().get("choices", [])))

        thread = threading.Thread(target=send_big)
        thread.start()
        time.sleep(config.delay_s)                   # the fan-out holds every slot by now
        during = [_other_latency(url)]              # then one after another while the fan-out runs
        while thread.is_alive() and len(during) < config.max_during:
            during.append(_other_latency(url))
        thread.join()
        return {"share": share, "alone_s": alone, "during_s": during, "during_max_s": max(during),
                "during_median_s": statistics.median(during), "alone_median_s": statistics.median(alone),
                "fan_out": big}
    finally:
        for proc in (router, worker):
            proc.terminate()
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="the other client's requests alone")
    p.add_argument("--max-during", type=int, default=50, help="its requests while the fan-out runs, at most")
    p.add_argument("--delay-s", type=float, default=2.0, help="from the fan-out's start to the other client's")
    p.add_argument("--shares", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--out", default=str(RESULTS / "fairness.json"))
    config = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kimi-pd-fairness-"))
    runs = [one_share(share, config, workdir) for share in config.shares]
    report = {"config": {k: v for k, v in vars(config).items() if k != "out"}, "max_num_seqs": 8,
              "model": "tiny-chat", "load_average": os.getloadavg(), "runs": runs}
    Path(config.out).write_text(json.dumps(report, indent=2) + "\n")
    for run in runs:
        print(f"share {run['share']}: other client alone {run['alone_median_s']:.2f} s, during the fan-out "
              f"{run['during_median_s']:.2f} s median, {run['during_max_s']:.2f} s max of {len(run['during_s'])} "
              f"(fan-out {run['fan_out'].get('seconds', 0):.1f} s, "
              f"{run['fan_out'].get('choices')} choices)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
