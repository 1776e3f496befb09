"""`kimi-pd up --autoscale` on a tiny fleet: a load step up adds a decode worker, the step down
retires it (SIGTERM: it deregisters, finishes what it serves, exits), and no request fails across
either change. Stated times: the new worker is started within 15 s of the step (a few readings of
the store at 1 s, heartbeats at 1 s) and registered with the router within 150 s (a worker's start-up
on a loaded 2-core machine); it is retired within the 6 s down-window + 3 s step + 2 readings (+5 s
slack) after the load ends, and deregistered within 30 s more; every request sent meanwhile succeeds."""
from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.fleet import kimi_pd_up

pytestmark = pytest.mark.timeout(400)
TOKEN = "autoscale-test-admin-token"


class Lines:
    """`kimi-pd up`'s output after start-up, read in the background (it logs every scaling action)."""

    def __init__(self, proc) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, text: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in self.lines:
                if text in line:
                    return at
            time.sleep(0.2)
        pytest.fail(f"no {text!r} within {timeout_s} s:\n" + "".join(line for _, line in self.lines[-30:]))


def complete(url: str, max_tokens: int) -> int:
    body = {"model": "kimi-k3", "prompt": "count: 1 2 3", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
    return resp.status_code if resp.status_code != 200 else (200 if resp.json()["usage"]["completion_tokens"]
                                                              == max_tokens else -1)


def workers(url: str) -> dict[str, dict]:
    resp = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    resp.raise_for_status()
    body = resp.json()
    return {w["worker_id"]: w for w in (body["workers"] if isinstance(body, dict) else body)}


def wait_workers(url: str, check, timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = workers(url)
        if check(seen):
            return seen
        time.sleep(0.5)
    pytest.fail(f"the router's workers never satisfied the check: {sorted(workers(url))}")


def test_pools_follow_a_load_step_and_scale_in_loses_nothing(tmp_path, e2e_model):
    model = tmp_path / "model-for-autoscale"
    shutil.copytree(e2e_model, model)
    args = ["--model", str(model), "--autoscale", "--prefill-bounds", "1:1", "--decode-bounds", "1:2",
            "--autoscale-interval-s", "1", "--scale-down-window-s", "6", "--scale-down-step-s", "3"]
    env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": TOKEN}
    with kimi_pd_up(args, tmp_path / "logs", env=env) as (url, proc), ThreadPoolExecutor(32) as pool:
        out, results, stop = Lines(proc), [], threading.Event()

        def load() -> None:                        # 14 requests in flight (> 6 a decode worker) until told
            inflight: list = []
            while not stop.is_set():
                inflight = [f for f in inflight if not f.done()]
                while len(inflight) < 14:
                    inflight.append(pool.submit(complete, url, 48))
                    results.append(inflight[-1])
                time.sleep(0.1)

        step = time.monotonic()
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        assert out.wait_for("autoscale +decode-1", 15) - step <= 15
        wait_workers(url, lambda seen: "decode-1" in seen, 150)              # registered: the router uses it
        stop.set()
        loader.join(10)
        ended = time.monotonic()
        while time.monotonic() < ended + 25 and not any("-decode-1" in line for _, line in out.lines):
            results.append(pool.submit(complete, url, 8))                  # keeps going across scale-in
            time.sleep(0.5)
        assert out.wait_for("autoscale -decode-1", 1) - ended <= 6 + 3 + 2 + 5
        for _ in range(6):
            results.append(pool.submit(complete, url, 8))
            time.sleep(0.5)
        wait_workers(url, lambda seen: "decode-1" not in seen and "decode-0" in seen, 30)   # deregistered
        codes = [f.result() for f in results]
        assert codes == [200] * len(codes), f"failed across scaling: {[c for c in codes if c != 200]}"
        assert len(codes) > 40
