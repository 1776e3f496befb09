"""Event-loop stalls, measured: a periodic wake-up that notes how late it ran.

A server whose loop is blocked (a synchronous call on the request path) or starved (more busy
processes than cores) answers nothing meanwhile, health probes included, and its request latencies
do not say why. The lateness of a timer that should have fired says it directly: every tick goes to
a histogram, and a stall of `warn_s` or more is logged (at most once per `quiet_s`) with its length.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_S = 0.25               # 4 wake-ups a second; ~0.2 ms of CPU each on the 2-core host: < 0.1% of a core
WARN_S = 1.0                # a stall a client would notice: logged
QUIET_S = 30.0              # at most one such line per this many seconds (a starved host stalls often)


async def watch_loop(stop: asyncio.Event, observe: Callable[[float], None], name: str,
                     tick_s: float = TICK_S, warn_s: float = WARN_S, quiet_s: float = QUIET_S) -> None:
    """Until `stop`: `observe(lateness)` every `tick_s`, and a warning for stalls of `warn_s` or more: at once
    for the first, then at most one line per `quiet_s` naming the longest since the last line (a stall
    held back is reported by the first tick after `quiet_s`, stalled or not)."""
    loop = asyncio.get_running_loop()
    last_line, worst, stalls = -quiet_s, 0.0, 0
    while not stop.is_set():
        due = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        now = loop.time()
        late = max(0.0, now - due)
        observe(late)
        if late >= warn_s:
            worst, stalls = max(worst, late), stalls + 1
        if stalls and now - last_line >= quiet_s:
            log.warning("%s: the event loop stalled %.1f s (%d stall(s) of %.1f s or more since the last such "
                        "line): a blocking call in a handler, or more busy processes than cores",
                        name, worst, stalls, warn_s)
            last_line, worst, stalls = now, 0.0, 0
