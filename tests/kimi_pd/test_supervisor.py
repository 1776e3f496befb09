"""`kimi-pd up` supervision: a dead child is restarted (same command) after a backoff that doubles
while it keeps crashing and resets once it has run for a while; every exit and restart is reported."""
from __future__ import annotations

import sys

from kimi_pd.processes import Backoff, Processes, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_exit(child) -> None:
    child.popen.wait(10)


def test_backoff_doubles_and_is_capped():
    b = Backoff(first_s=0.5, max_s=4.0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_dead_child_is_restarted_after_backoff_and_reported(tmp_path):
    clock, lines, procs = Clock(), [], Processes()
    sup = Supervisor(procs, Backoff(first_s=1.0, max_s=8.0, reset_after_s=60.0), lines.append, clock)
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    steady = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        first = sup.spawn("crashy", crash, {}, tmp_path / "crashy.log")
        sup.spawn("steady", steady, {}, tmp_path / "steady.log")
        wait_exit(first)
        sup.poll()                                                 # exit noticed: restart due in 1 s
        assert "crashy exited (code 3)" in lines[-1] and "restarting in 1.0 s" in lines[-1]
        clock.now = 0.5
        sup.poll()
        assert sup.restarts("crashy") == 0                         # not yet
        clock.now = 1.0
        sup.poll()
        assert sup.restarts("crashy") == 1 and "restarted crashy" in lines[-1]
        wait_exit(procs.children[-1])
        clock.now = 2.0
        sup.poll()
        assert "restarting in 2.0 s" in lines[-1]                  # crashing again soon: doubled
        clock.now = 4.0
        sup.poll()
        assert sup.restarts("crashy") == 2
        wait_exit(procs.children[-1])
        clock.now = 100.0                                          # ran > reset_after_s: back to the first delay
        sup.poll()
        assert "restarting in 1.0 s" in lines[-1]
        assert sup.restarts("steady") == 0 and len(procs.children) == 2
        assert all(c.popen.poll() is None for c in procs.children if c.name == "steady")
    finally:
        procs.stop(grace_s=2)
