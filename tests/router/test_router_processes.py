"""`kimi-pd router --workers 2`: two real router processes on one port, in front of two stub decode workers.

Both processes take requests (the x-kimi-pd-router-process header names the one that served), and the
router places as one: the same request sequences land as they do through one router in this process,
even when a sibling took the request that made the load or cached the prefix. /metrics adds up every
process, /admin/workers answers the same from either, a killed child is restarted (and counted) while the
port keeps serving, and SIGTERM to the parent stops every child. The tests run in file order on one fleet."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.settings import RouterSettings
from shared.net import free_port
from tests.router.fake_vllm import Servers
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "engine" / "presets_data" / "tiny-chat"
DELAY_S = 1.5
ADMIN = "procs-admin-token"
PREFIX = "the shared system prompt says hello " * 60


class Stub:
    """A decode stub whose answers take DELAY_S: every leg is still open when the next ones are placed."""

    port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self):
        return stub_app(StubSettings(role="decode", tokens=2, first_token_delay_s=DELAY_S))


def flags(workers: list[Stub]) -> dict:
    return {"static_decode": tuple(w.url for w in workers), "disagg_threshold_tokens": 10 ** 6,
            "prefill_tokens_per_s": 1000.0, "static_cache_tokens": 1 << 20, "placement_headers": True,
            "health_check_s": 5.0}


class Fleet:
    def __init__(self, workers: list[Stub], tmp: Path) -> None:
        self.workers, self.port, self.log = workers, free_port(), tmp / "router.log"
        argv = [sys.executable, "-m", "kimi_pd", "router", "--model", str(MODEL_DIR), "--workers", "2",
                "--port", str(self.port), "--placement-headers", "--disagg-threshold", str(10 ** 6),
                "--prefill-tokens-per-s", "1000", "--static-cache-tokens", str(1 << 20),
                "--health-check-interval", "5", "--shutdown-timeout", "10"]
        for w in workers:
            argv += ["--decode", w.url]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KIMI_PD_ADMIN_TOKEN": ADMIN}
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def started(self) -> int:
        return self.log.read_text().count("Application startup complete")

    def child_pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"router process \d started \(pid (\d+)\)", self.log.read_text())}

    def post(self, prompt: str) -> tuple[str, str]:
        """(decode worker, router process) of one completion on a connection of its own."""
        with httpx.Client(base_url=self.url, timeout=30) as client:
            resp = client.post("/v1/completions", json={"model": "kimi-k3", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kimi-pd-decode-worker"], resp.headers["x-kimi-pd-router-process"]

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}) as client:
            return client.get(path)


def until(check: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    workers = [Stub(), Stub()]
    with Servers(*workers):
        f = Fleet(workers, tmp_path_factory.mktemp("procs"))
        try:
            until(lambda: f.started() == 2 or f.proc.poll() is not None, "both router processes")
            assert f.proc.poll() is None, f.log.read_text()[-3000:]
            yield f
        finally:
            if f.proc.poll() is None:
                f.proc.send_signal(signal.SIGTERM)
                try:
                    f.proc.wait(20)
                except subprocess.TimeoutExpired:
                    f.proc.kill()
            for pid in f.child_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def inflight(f: Fleet) -> int:
    return sum(w["inflight"] for w in f.get("/admin/workers").json()["workers"])


def concurrently(send: Callable[[str], tuple[str, str]], prompts: list[str]) -> list[tuple[str, str]]:
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = send(prompts[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def load_sequence(send, open_legs: Callable[[], int]) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """A big prompt (3 s of queued work), then four small ones while it is open: where each went."""
    big: list = []
    thread = threading.Thread(target=lambda: big.append(send("big " * 3000)))
    thread.start()
    until(lambda: open_legs() == 1, "the big leg", 10)
    smalls = concurrently(send, [f"small{i} " * 300 for i in range(4)])
    thread.join(30)
    return big[0], smalls


def prefix_sequence(send) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """A long shared prefix, then six prompts that extend it, at once."""
    first = send(PREFIX + "first")
    return first, concurrently(send, [PREFIX + f"question {i}" for i in range(6)])


def one_router(workers: list[Stub]) -> TestClient:
    return TestClient(create_app(RouterSettings(model=str(MODEL_DIR), **flags(workers))))


def via(client: TestClient) -> Callable[[str], tuple[str, str]]:
    def send(prompt: str) -> tuple[str, str]:
        resp = client.post("/v1/completions", json={"model": "kimi-k3", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kimi-pd-decode-worker"], "0"
    return send


def test_both_processes_serve_and_metrics_add_up(fleet):
    before = fleet.get("/metrics").text
    seen: set[str] = set()
    sent = 0
    while len(seen) < 2 and sent < 40:
        seen |= {p for _, p in concurrently(fleet.post, ["hello"] * 4)}
        sent += 4
    assert len({p.split(":")[0] for p in seen}) == 2, f"one process took all {sent} requests: {seen}"
    after = fleet.get("/metrics").text

    def ok_total(text: str) -> float:
        return sum(float(v) for v in re.findall(
            r'kimi_pd_router_requests_total\{decision="decode-only",endpoint="completions",outcome="ok"\} (\S+)', text))
    assert ok_total(after) - ok_total(before) == sent, "every process's requests in one /metrics"
    per_process = [float(v) for v in re.findall(r'kimi_pd_router_process_requests_total\{process="\d"\} (\S+)', after)]
    assert len(per_process) == 2 and all(n > 0 for n in per_process)
    assert 'kimi_pd_router_workers{healthy="true",role="decode"} 2.0' in after    # not 4: a gauge, not a sum

    def ticks() -> float:
        found = re.search(r"^kimi_pd_router_event_loop_lag_seconds_count (\S+)$", fleet.get("/metrics").text, re.M)
        assert found, "the stall watch's histogram is on the page"
        return float(found.group(1))
    first = ticks()
    time.sleep(3.0)              # 4 ticks a second in each process: one process alone adds at most 13
    assert ticks() - first >= 16, "both processes' stall watch, in one histogram"


def test_load_opened_by_one_process_steers_the_other_as_in_one_router(fleet):
    with one_router(fleet.workers) as one:
        big, smalls = load_sequence(via(one), lambda: sum(one.app.state.registry.inflight.values()))
    assert {w for w, _ in smalls} == {w.url for w in fleet.workers} - {big[0]}, "one router: smalls avoid the big"
    for _ in range(4):                            # until a sibling of the big one's process placed a small one
        big, smalls = load_sequence(fleet.post, lambda: inflight(fleet))
        assert {w for w, _ in smalls} == {w.url for w in fleet.workers} - {big[0]}, (big, smalls)
        if any(p != big[1] for _, p in smalls):
            return
    pytest.fail("every small request was served by the process that served the big one")


def test_a_prefix_cached_through_one_process_is_followed_by_the_other(fleet):
    with one_router(fleet.workers) as one:
        first, rest = prefix_sequence(via(one))
    assert {w for w, _ in rest} == {first[0]}, "one router: the prefix's holder takes the rest"
    first, rest = prefix_sequence(fleet.post)
    assert {w for w, _ in rest} == {first[0]}, (first, rest)
    assert any(p != first[1] for _, p in rest), "no sibling process placed a request this time"


def test_admin_answers_the_same_from_either_process(fleet):
    token_free = [fleet.get("/admin/workers").json()["workers"] for _ in range(6)]
    shapes = [sorted((w["worker_id"], w["healthy"], w["draining"]) for w in ws) for ws in token_free]
    assert all(s == shapes[0] for s in shapes) and len(shapes[0]) == 2


def test_a_killed_child_is_restarted_while_the_port_serves(fleet):
    _, process = fleet.post("hello")
    index, pid = (int(x) for x in process.split(":"))
    os.kill(pid, signal.SIGKILL)
    until(lambda: "\nkimi_pd_router_process_restarts_total 1.0" in fleet.get("/metrics").text,
          "the restart counted", 20)
    assert f"router process {index} (pid {pid}) exited" in fleet.log.read_text()
    until(lambda: len(fleet.child_pids()) == 3, "a new process for the dead one", 10)
    for _ in range(2):
        fleet.post("still served")               # the sibling holds the port meanwhile


def test_sigterm_stops_every_process(fleet):
    pids = fleet.child_pids()
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(15) == 0
    for pid in pids:
        until(lambda pid=pid: gone(pid), f"child {pid} gone", 5)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True
