"""Data-parallel ranks across "hosts" (processes on loopback with vLLM's flags) when one side dies:
a headless node whose front is SIGKILLed exits by itself (its gloo connection closes), and a front
whose headless DP rank is SIGKILLed fails the next request explicitly and exits 70 for supervision,
instead of hanging in a collective."""
from __future__ import annotations

import time

import httpx
import pytest

from shared.net import free_port
from tests.e2e.fleet import Fleet

pytestmark = pytest.mark.timeout(300)


def dp_pair(f: Fleet, name: str):
    """A `-dp 2` decode worker (DP rank 0, serving) and its headless node (DP rank 1), both ready."""
    across = ("--enable-expert-parallel", "-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(free_port()))
    front = f.worker("decode", name, *across)
    node = f.worker("decode", f"{name}-node1", *across, "-dpr", "1", "--headless")
    f.wait(front, timeout_s=240)
    return front, node


def exit_code_within(proc, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            return proc.popen.returncode
        time.sleep(0.2)
    return None


def test_a_headless_node_exits_when_its_front_dies(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        front, node = dp_pair(f, "d-front-dies")
        front.kill()
        code = exit_code_within(node, 60)
        assert code not in (None, 0), f"headless node still running or exited cleanly ({code})"


def test_a_front_whose_remote_rank_dies_fails_explicitly_and_exits_70(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        front, node = dp_pair(f, "d-rank-dies")
        node.kill()
        body = {"model": "kimi-k3", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
        try:
            got = httpx.post(front.url + "/v1/completions", json=body, timeout=120)
            assert got.status_code >= 500, got.text
        except httpx.HTTPError:
            pass                                           # the worker may exit before it answers
        assert exit_code_within(front, 60) == 70
