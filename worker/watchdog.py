"""A worker whose engine died exits, so supervision (`kimi-pd up`, Docker's restart policy,
Kubernetes) starts a fresh one: a dead engine never recovers, and a process that stays up answering
503 `engine_dead` is one nothing restarts. For a tensor-parallel engine, a follower rank of this
host that exits is a death too (a rank on another host shows up as the next step's failed collective).
Before exiting, the worker reports dead on /health and leaves the store, so routers stop at once."""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)
EXIT_ENGINE_DEAD = 70                          # EX_SOFTWARE: not a clean stop


async def watch_engine(runtime, interval_s: float = 0.5, grace_s: float = 1.0,
                       exit_fn: Callable[[int], object] = os._exit) -> None:
    """Poll the engine; on its death: mark it dead (if a rank went), deregister, wait `grace_s`, exit."""
    engine = runtime.engine
    while True:
        await asyncio.sleep(interval_s)
        if runtime.draining:
            return
        tp = getattr(engine.engine, "tp", None)
        if not engine.is_dead and tp is not None and not tp.alive():
            engine.mark_dead(RuntimeError("a tensor-parallel rank of this worker exited"))
        if engine.failed:
            break
    log.error("engine dead (%r); exiting with %d so supervision restarts this worker", engine._dead,
              EXIT_ENGINE_DEAD)
    if runtime.presence is not None:
        try:
            await asyncio.wait_for(runtime.presence.stop(), timeout=grace_s)
        except Exception as exc:  # noqa: BLE001 - exiting anyway (a timeout included)
            log.warning("could not deregister before exiting: %r", exc)
    await asyncio.sleep(grace_s)
    exit_fn(EXIT_ENGINE_DEAD)
