"""The interop fleet's own port plan and its fail-fast on a taken port (cheap; no vLLM started)."""
from __future__ import annotations

import socket
import sys
import time

import pytest

from kimi_pd.processes import Processes
from tests.interop.vllm_fleet import ListenPorts, PortClash, ephemeral_low, wait_ready


def test_ports_are_outside_the_ephemeral_range_and_never_given_twice():
    plan = ListenPorts()
    firsts = [plan.block(40) for _ in range(20)] + [plan.block() for _ in range(50)]
    given = [p for first in firsts[:20] for p in range(first, first + 40)] + firsts[20:]
    assert len(given) == len(set(given)) == 850
    assert max(given) < ephemeral_low()


def test_a_port_held_by_a_listener_is_not_given():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        plan = ListenPorts()
        plan.low, plan.high = held.getsockname()[1] - 1, held.getsockname()[1] + 2
        for _ in range(5):
            assert plan.block() != held.getsockname()[1]
            plan.given.clear()


def test_a_taken_port_fails_the_wait_at_once(tmp_path):
    processes = Processes()
    try:
        child = processes.spawn("p1", [sys.executable, "-c", (
            "import time; print('zmq.error.ZMQError: Address already in use', flush=True); time.sleep(60)")],
            {}, tmp_path / "p1.log")
        started = time.monotonic()
        with pytest.raises(PortClash):
            wait_ready(child, "http://127.0.0.1:9", 30)
        assert time.monotonic() - started < 10
    finally:
        processes.stop(grace_s=2)
