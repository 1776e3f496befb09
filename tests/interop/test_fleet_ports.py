"""The interop fleet's fail-fast on a taken port (cheap; no vLLM started; the port plan: tests/shared/test_net.py)."""
from __future__ import annotations

import sys
import time

import pytest

from kimi_pd.processes import Processes
from tests.interop.vllm_fleet import PortClash, wait_ready


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
