"""A worker's presence in the state store: registration, heartbeats with load, KV events, snapshots.

Two loops. Heartbeats (registration and load) never wait on the engine thread: the load is read from
counters, so a worker whose engine is stuck in one long command keeps its registration and reports how
long it has been busy (`engine_busy_s`) instead of vanishing from every router. KV events and snapshots
need the engine thread and have a loop of their own, which may lag while the engine is busy.

Store outages never stop serving: failures are logged (once per outage) and retried on the next
tick; when a heartbeat says the registration is gone (Redis restarted), the worker registers again
and re-seeds its KV stream with a fresh snapshot, so routers rebuild their index.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from engine.async_engine import AsyncEngine
from shared.kv_events import KVEventBatch
from shared.store.base import StateStore, StoreError
from shared.workers import LoadReport, WorkerInfo

log = logging.getLogger(__name__)


class WorkerPresence:
    def __init__(self, store: StateStore, info: WorkerInfo, engine: AsyncEngine, heartbeat_s: float,
                 ttl_s: float, snapshot_every_s: float = 30.0) -> None:
        self.store, self.info, self.engine = store, info, engine
        self.heartbeat_s, self.ttl_s, self.snapshot_every_s = heartbeat_s, ttl_s, snapshot_every_s
        self.draining = False
        self._registered = False
        self._needs_snapshot = True                        # after every (re-)registration
        self._last_snapshot = 0.0
        self._outage = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        wid = self.info.worker_id
        self._tasks = [asyncio.create_task(self._run(self.tick), name=f"presence-{wid}"),
                       asyncio.create_task(self._run(self.publish_events), name=f"kv-events-{wid}")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.store.deregister(self.info.worker_id)
        except StoreError as exc:
            log.warning("could not deregister %s: %s", self.info.worker_id, exc)

    def load(self) -> LoadReport:
        s = self.engine.stats()
        return LoadReport(running=s["running"], waiting=s["waiting"], held=s["held"], cache_usage=s["cache_usage"],
                          capacity_tokens=s["capacity_tokens"], draining=self.draining, ts=time.time(),
                          engine_busy_s=round(s["busy_s"], 3))

    async def _run(self, round_: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await round_()
                if self._outage:
                    log.info("state store reachable again")
                self._outage = False
            except Exception as exc:                       # noqa: BLE001 - presence must outlive store faults
                if not self._outage:
                    log.warning("state store unavailable, serving on: %s", exc)
                # events drained during the outage are lost: re-register and re-snapshot once it is back
                self._outage, self._registered = True, False
            await asyncio.sleep(self.heartbeat_s)

    async def tick(self) -> None:
        """One heartbeat round: (re-)register, then heartbeat with the load. Never waits on the engine."""
        if not self._registered:
            await self.store.register(replace(self.info, started_at=self.info.started_at or time.time()), self.ttl_s)
            self._registered, self._needs_snapshot = True, True
        if not await self.store.heartbeat(self.info.worker_id, self.load(), self.ttl_s):
            # routers dropped us for up to a heartbeat: a stalled loop or a store that lost our keys
            log.warning("registration of %s lapsed (no heartbeat within %.1f s); registering again",
                        self.info.worker_id, self.ttl_s)
            self._registered = False

    async def publish_events(self) -> None:
        """One KV-event round: the snapshot a (re-)registration asked for or that is due, else new events."""
        if not self._registered:
            return
        if self._needs_snapshot or time.monotonic() - self._last_snapshot > self.snapshot_every_s:
            self._needs_snapshot = False
            await self._snapshot()
            return
        events = await self.engine.call(lambda: self.engine.engine.cache.drain_events())
        if events:
            await self.store.publish_kv_events(self.info.worker_id, KVEventBatch(time.time(), events))

    async def _snapshot(self) -> None:
        """Seed/refresh: publish pending events, then the full set of hashes at the returned seq."""
        events = await self.engine.call(lambda: self.engine.engine.cache.drain_events())
        seq = await self.store.publish_kv_events(self.info.worker_id, KVEventBatch(time.time(), events))
        hashes = await self.engine.call(lambda: list(self.engine.engine.cache.pool.hash_to_block))
        await self.store.write_kv_snapshot(self.info.worker_id, seq, hashes)
        self._last_snapshot = time.monotonic()
