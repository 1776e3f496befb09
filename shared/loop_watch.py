"""Event-loop stalls, measured: a periodic wake-up that notes how late it ran.

A server whose loop is blocked (a synchronous call on the request path) or starved (more busy
processes than cores) answers nothing meanwhile, health probes included, and its request latencies
do not say why. The lateness of a timer that should have fired says it directly: every tick goes to
a histogram, and a stall of `warn_s` or more is logged (at most once per `quiet_s`) with its length.

A stall cannot explain itself from inside the loop, so a thread looks at it from outside: when the loop
has not ticked for `inspect_s`, it logs what the loop thread is doing (its stack and every other
thread's), how much CPU the loop thread used meanwhile, and how late the inspector itself woke. Those
tell the causes apart: computing (the loop thread's CPU time grows), starved (its time waiting for a CPU
grows: Linux's per-thread schedstat), stopped (neither, and the inspector itself woke late: SIGSTOP, a
frozen cgroup, a paused host), or blocked (none of these: a lock, the GIL, a system call).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_S = 0.25               # 4 wake-ups a second; ~0.2 ms of CPU each on the 2-core host: < 0.1% of a core
WARN_S = 1.0                # a stall a client would notice: logged
QUIET_S = 30.0              # at most one such line per this many seconds (a starved host stalls often)
INSPECT_S = 3.0             # a stall this long gets its stacks logged, by the inspector thread
STACK_LINES = 12            # innermost frames kept per thread


async def watch_loop(stop: asyncio.Event, observe: Callable[[float], None], name: str,
                     tick_s: float = TICK_S, warn_s: float = WARN_S, quiet_s: float = QUIET_S,
                     inspect_s: float | None = INSPECT_S) -> None:
    """Until `stop`: `observe(lateness)` every `tick_s`, and a warning for stalls of `warn_s` or more: at once
    for the first, then at most one line per `quiet_s` naming the longest since the last line (a stall
    held back is reported by the first tick after `quiet_s`, stalled or not). With `inspect_s`, a
    `StallInspector` thread explains stalls that long (None: no thread)."""
    loop = asyncio.get_running_loop()
    # a thread's CPU clock, read from another thread, is POSIX; without it no inspector
    inspector = (StallInspector(name, inspect_s, quiet_s)
                 if inspect_s is not None and hasattr(time, "pthread_getcpuclockid") else None)
    last_line, worst, stalls = -quiet_s, 0.0, 0
    try:
        while not stop.is_set():
            if inspector is not None:
                inspector.beat()
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
    finally:
        if inspector is not None:
            inspector.close()


class StallInspector:
    """A daemon thread that checks the loop's heartbeat (`beat`, called on the loop thread) and, once per
    stall of `inspect_s` or more (at most one per `quiet_s`), logs the stacks and the CPU evidence."""

    def __init__(self, name: str, inspect_s: float, quiet_s: float) -> None:
        self.name, self.inspect_s, self.quiet_s = name, inspect_s, quiet_s
        self.loop_thread = threading.get_ident()
        self._clock = time.pthread_getcpuclockid(self.loop_thread)
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._beat = (time.monotonic(), time.thread_time(), run_queue_wait(self._schedstat))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stall-inspector {name}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """On the loop thread: it is alive now (wall clock, its CPU clock, its wait for a CPU so far)."""
        self._beat = (time.monotonic(), time.thread_time(), run_queue_wait(self._schedstat))

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        period = min(0.5, self.inspect_s / 3)
        reported_beat, last_report = -1.0, -self.quiet_s
        expected = time.monotonic() + period
        while not self._closed.wait(max(0.0, expected - time.monotonic())):
            now = time.monotonic()
            own_lateness, expected = now - expected, now + period
            beat_at, beat_cpu, beat_wait = self._beat
            stalled = now - beat_at
            if stalled < self.inspect_s or beat_at == reported_beat or now - last_report < self.quiet_s:
                continue
            reported_beat, last_report = beat_at, now
            try:
                loop_cpu = time.clock_gettime(self._clock) - beat_cpu
            except OSError:          # the loop thread is gone: the server is stopping
                return
            wait = run_queue_wait(self._schedstat)
            queued = None if wait is None or beat_wait is None else wait - beat_wait
            log.warning("%s: the event loop has not run for %.1f s; %s", self.name, stalled,
                        explain_stall(stalled, loop_cpu, queued, own_lateness, self.loop_thread))


def run_queue_wait(schedstat: str) -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (None where the kernel does not say)."""
    try:
        with open(schedstat) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def explain_stall(stalled: float, loop_cpu: float, queued: float | None, own_lateness: float,
                  loop_thread: int) -> str:
    """The verdict, its evidence, then every thread's innermost frames (the loop thread first)."""
    if loop_cpu >= stalled / 2:
        verdict = "it is computing (a long synchronous step on the loop)"
    elif queued is not None and queued >= stalled / 2:
        verdict = "it is starved: runnable but waiting for a CPU (more busy processes than cores)"
    elif own_lateness >= stalled / 2:
        verdict = ("the whole process was stopped: neither thread ran nor waited for a CPU (SIGSTOP, a debugger, "
                   "a frozen cgroup, or the host paused)")
    else:
        verdict = "it is blocked, not computing (a lock, the GIL held by another thread, or a system call)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    waited = "unknown" if queued is None else f"{queued:.2f} s"
    lines = [f"{verdict}: the loop thread used {loop_cpu:.2f} s of CPU and waited {waited} for one meanwhile; "
             f"this inspector woke {own_lateness:.2f} s late; load average {load:.1f}"]
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident in sorted(frames, key=lambda i: i != loop_thread):
        if ident == threading.get_ident():
            continue
        label = "loop thread" if ident == loop_thread else f"thread {names.get(ident, ident)!r}"
        stack = traceback.format_stack(frames[ident])[-STACK_LINES:]
        lines.append(f"{label}:\n" + "".join(stack).rstrip())
    return "\n".join(lines)
