"""shared/loop_watch.py: a blocked event loop is measured and logged; a free one is not; stalls close
together are summed up in one line, which comes out even when no later stall follows; a long stall is
explained from outside the loop (blocked or computing, and where)."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

from shared.loop_watch import explain_stall, watch_loop

BLOCK_S, WARN_S = 0.5, 0.35           # far above what a busy 2-core host adds to a 20 ms timer


async def _watch_while(work, **kw) -> list[float]:
    seen: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_loop(stop, seen.append, "test", **kw))
    await work()
    stop.set()
    await asyncio.wait_for(watcher, 5)
    return seen


def _stalled(records) -> list[tuple[float, int]]:
    """(longest stall, count) of each warning line."""
    found = [re.search(r"test: the event loop stalled ([\d.]+) s \((\d+) stall", r.getMessage()) for r in records]
    assert all(found), [r.getMessage() for r in records]
    return [(float(m.group(1)), int(m.group(2))) for m in found if m]


def test_a_blocking_call_is_measured_and_logged(caplog):
    async def block():
        await asyncio.sleep(0.05)            # the watcher's timer is armed
        time.sleep(BLOCK_S)                  # a synchronous call on the loop
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        seen = asyncio.run(_watch_while(block, tick_s=0.02, warn_s=WARN_S, quiet_s=30, inspect_s=None))
    assert max(seen) >= BLOCK_S - 0.1, seen
    [(longest, count)] = _stalled(caplog.records)
    assert longest >= BLOCK_S - 0.1 and count == 1


def test_a_free_loop_is_quiet(caplog):
    async def idle():
        await asyncio.sleep(0.4)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        seen = asyncio.run(_watch_while(idle, tick_s=0.02, warn_s=1.0))
    assert len(seen) >= 3 and not caplog.records and max(seen) < 1.0, seen


def test_stalls_within_the_quiet_time_are_summed_up_once_it_is_over(caplog):
    """Two stalls 0.1 s apart with a quiet time of 0.8 s: the first is logged at once; the second is held
    back, then reported by a tick after the quiet time although nothing stalls then."""
    async def stall_twice_then_idle():
        for _ in range(2):
            await asyncio.sleep(0.05)
            time.sleep(BLOCK_S)
        await asyncio.sleep(1.0)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        seen = asyncio.run(_watch_while(stall_twice_then_idle, tick_s=0.02, warn_s=WARN_S, quiet_s=0.8,
                                        inspect_s=None))
    assert sum(late >= WARN_S for late in seen) >= 2, seen
    lines = _stalled(caplog.records)
    assert len(lines) == 2 and lines[0][1] == 1 and lines[1][1] >= 1, lines


def _explained(records) -> list[str]:
    return [r.getMessage() for r in records if "has not run for" in r.getMessage()]


def _sleep_on_the_loop():
    time.sleep(1.0)


def _spin_on_the_loop():
    end = time.thread_time() + 0.8           # 0.8 s of this thread's own CPU, however busy the host
    while time.thread_time() < end:
        pass


def _explain(caplog, sync_call) -> str:
    """The one explanation the inspector (0.4 s) logs while `sync_call` runs on the loop."""
    async def work():
        await asyncio.sleep(0.05)
        sync_call()
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        asyncio.run(_watch_while(work, tick_s=0.02, warn_s=5, inspect_s=0.4))
    [line] = _explained(caplog.records)
    return line


def test_a_blocked_loop_is_explained_from_outside_with_its_stack(caplog):
    """The inspector thread sees the loop silent for 0.4 s, finds its thread used no CPU, and names the
    call it is stuck in; one line per stall."""
    line = _explain(caplog, _sleep_on_the_loop)
    assert "it is blocked, not computing" in line, line
    cpu = float(re.search(r"used ([\d.]+) s of CPU", line).group(1))
    assert cpu < 0.1, line
    loop_stack = line.split("loop thread:\n", 1)[1]
    assert "in _sleep_on_the_loop" in loop_stack.split("thread '")[0], line


def test_a_computing_loop_is_explained_with_its_cpu_and_stack(caplog):
    line = _explain(caplog, _spin_on_the_loop)
    assert "blocked" not in line.split(":")[1], line       # computing, or starved on a crowded host
    assert float(re.search(r"used ([\d.]+) s of CPU", line).group(1)) > 0.1, line
    assert "in _spin_on_the_loop" in line, line


def test_the_verdict_follows_the_evidence():
    me = threading.get_ident()
    assert "computing" in explain_stall(4.0, 3.0, 0.5, 0.0, me)
    assert "starved" in explain_stall(4.0, 0.2, 3.5, 0.0, me)
    assert "blocked" in explain_stall(4.0, 0.0, 0.0, 0.0, me)
    assert "blocked" in explain_stall(4.0, 0.0, None, 0.1, me)      # no schedstat: not called starvation
    assert "stopped" in explain_stall(8.0, 0.0, 0.0, 7.7, me)       # SIGSTOP: the inspector froze with it
