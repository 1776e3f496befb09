"""shared/loop_watch.py: a blocked event loop is measured and logged; a free one is not."""
from __future__ import annotations

import asyncio
import logging
import time

from shared.loop_watch import watch_loop


async def _watch_while(work, **kw) -> list[float]:
    seen: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_loop(stop, seen.append, "test", **kw))
    await work()
    stop.set()
    await asyncio.wait_for(watcher, 5)
    return seen


def test_a_blocking_call_is_measured_and_logged(caplog):
    async def block():
        await asyncio.sleep(0.05)            # the watcher's timer is armed
        time.sleep(0.3)                      # a synchronous call on the loop
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        seen = asyncio.run(_watch_while(block, tick_s=0.02, warn_s=0.2, quiet_s=30))
    assert max(seen) >= 0.25, seen
    assert sum(late >= 0.2 for late in seen) == 1, seen
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "test: the event loop stalled 0.3 s" in lines[0], lines


def test_a_free_loop_is_quiet_and_repeated_stalls_are_rate_limited(caplog):
    async def idle():
        await asyncio.sleep(0.2)

    async def stall_twice():
        for _ in range(2):
            await asyncio.sleep(0.05)
            time.sleep(0.25)

    with caplog.at_level(logging.WARNING, logger="shared.loop_watch"):
        idle_seen = asyncio.run(_watch_while(idle, tick_s=0.02, warn_s=1.0))
        assert len(idle_seen) >= 5 and not caplog.records and max(idle_seen) < 1.0, idle_seen
        twice = asyncio.run(_watch_while(stall_twice, tick_s=0.02, warn_s=0.2, quiet_s=30))
    assert sum(late >= 0.2 for late in twice) == 2, twice
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]    # the second one is held back
