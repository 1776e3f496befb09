"""A tensor-parallel worker whose follower rank is SIGKILLed exits 70 (EXIT_ENGINE_DEAD) within seconds, so
supervision restarts it, instead of staying up answering 503 engine_dead.

The default suite covers both halves without a killed process tree: tests/engine/parallel/
test_idle_and_rank_death.py (a dead follower makes the TP group report not alive) and tests/e2e/
test_tp_watchdog.py (the watchdog exits 70 once the group is not alive, and not before)."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.fleet import Fleet, eventually
from worker.watchdog import EXIT_ENGINE_DEAD

pytestmark = pytest.mark.timeout(240)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_tp_worker_whose_follower_dies_exits_for_supervision(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as fleet:
        worker = fleet.worker("worker", "w-tp2", "--tensor-parallel-size", "2")
        fleet.wait(worker, timeout_s=180)
        body = {"model": "kimi-k3", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        assert httpx.post(worker.url + "/v1/completions", json=body, timeout=60).status_code == 200
        followers = eventually(lambda: children(worker.popen.pid), 10, "the follower rank")
        os.kill(followers[0], signal.SIGKILL)
        start = time.monotonic()
        code = worker.popen.wait(30)
        assert code == EXIT_ENGINE_DEAD, worker.tail()
        assert time.monotonic() - start < 15
