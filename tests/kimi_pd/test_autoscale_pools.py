"""`kimi-pd up --autoscale`, its parts: the pool scaler moves pools toward the desired counts (starts
at once, one retirement a decision, never an empty pool), and the supervisor retires a worker with
SIGTERM and never restarts it."""
from __future__ import annotations

import sys
import time

import pytest

from kimi_pd.planner.pools import PoolScaler
from kimi_pd.processes import Processes, Supervisor


def scaler() -> tuple[PoolScaler, list[str]]:
    calls: list[str] = []
    s = PoolScaler(lambda role, name: calls.append(f"spawn {role} {name}"), lambda name: calls.append(f"retire {name}"))
    return s, calls


@pytest.mark.parametrize(("steps", "want_members", "want_done"), [
    ([{"prefill": 1, "decode": 1}], {"prefill": 1, "decode": 1}, [["+prefill-0", "+decode-0"]]),
    ([{"prefill": 1, "decode": 3}], {"prefill": 1, "decode": 3}, [["+prefill-0", "+decode-0", "+decode-1",
                                                                   "+decode-2"]]),
    ([{"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 1}], {"prefill": 1, "decode": 2},
     [["+prefill-0", "+decode-0", "+decode-1", "+decode-2"], ["-decode-2"]]),
    ([{"prefill": 2, "decode": 1}, {"prefill": 0, "decode": 0}, {"prefill": 0, "decode": 0}],
     {"prefill": 1, "decode": 1}, [["+prefill-0", "+prefill-1", "+decode-0"], ["-prefill-1"], []]),
    ([{"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}],
     {"prefill": 1, "decode": 2}, [["+prefill-0", "+decode-0", "+decode-1"], ["-decode-1"], ["+decode-2"]]),
])
def test_pool_scaler(steps, want_members, want_done):
    s, calls = scaler()
    done = [s.apply(d) for d in steps]
    assert done == want_done
    assert {p: len(m) for p, m in s.members.items()} == want_members
    assert [c for c in calls if c.startswith("retire")] == [f"retire {d[1:]}" for ds in done for d in ds
                                                            if d.startswith("-")]


def test_supervisor_retires_with_sigterm_and_never_restarts(tmp_path):
    lines: list[str] = []
    procs = Processes()
    sup = Supervisor(procs, report=lines.append)
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); time.sleep(60)"
    try:
        child = sup.spawn("decode-1", [sys.executable, "-c", code], {}, tmp_path / "d.log")
        sup.spawn("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "d0.log")
        time.sleep(0.5)                                       # the handler is installed
        sup.retire("decode-1")
        assert child.popen.wait(10) == 7, "it got SIGTERM (a worker drains on it), not SIGKILL"
        sup.poll()
        sup.poll()
        assert sup.names() == ["decode-0"] and "retiring decode-1" in lines[-1]
        assert not any("restart" in line for line in lines)
        assert child in procs.children, "the fleet still waits for it when stopping"
    finally:
        procs.stop(grace_s=2)
    assert all(c.popen.poll() is not None for c in procs.children)
