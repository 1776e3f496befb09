"""`InMemoryStore`: the state store inside one process (a lone router, unit tests).

Same semantics as `RedisStore` (see `shared.store.base`), with an injectable clock for TTLs: an entry
whose expiry time has passed is invisible and is dropped the next time it is looked at. Stream
trimming is exact here (approximate in Redis). Every method runs without awaiting, so each is atomic
with respect to other coroutines.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.kv_events import KVEventBatch, decode_batch, encode_batch
from shared.store.base import (
    DEFAULT_EVENTS_MAXLEN,
    DEFAULT_READ_LIMIT,
    DEFAULT_RETAIN_S,
    RouterLoads,
    WorkerRecord,
    check_read,
    check_ttl,
)
from shared.store.buckets import BucketResult, BucketSpec, LocalBuckets
from shared.workers import LoadReport, WorkerInfo


@dataclass
class _Worker:
    info: WorkerInfo
    load: LoadReport
    last_seen: float
    expires_at: float


@dataclass
class _KVState:
    """One worker's stream epoch and snapshot; they expire together (`retain_s` after last touch)."""

    expires_at: float
    last_seq: int | None = None                       # None: no epoch started yet
    entries: deque[tuple[int, bytes]] = field(default_factory=deque)
    snapshot: tuple[int, list[int]] | None = None


class InMemoryStore:
    """A `StateStore` held in this process's memory."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 events_maxlen: int = DEFAULT_EVENTS_MAXLEN, retain_s: float = DEFAULT_RETAIN_S) -> None:
        self._clock = clock
        self._maxlen = events_maxlen
        self._retain_s = retain_s
        self._workers: dict[str, _Worker] = {}
        self._kv: dict[str, _KVState] = {}
        self._last_seq_ever: dict[str, int] = {}      # survives epochs: new epochs start above it
        self._router_loads: dict[str, tuple[float, RouterLoads]] = {}
        self._buckets = LocalBuckets(clock)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        info.validate()                                # what routers will accept, checked at the source
        now = self._clock()
        self._workers[info.worker_id] = _Worker(info, LoadReport(), now, now + ttl_s)

    async def heartbeat(self, worker_id: str, load: LoadReport, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        worker = self._live_worker(worker_id)
        if worker is None:
            return False
        now = self._clock()
        worker.load, worker.last_seen, worker.expires_at = load, now, now + ttl_s
        self._touch_kv(worker_id)
        return True

    async def deregister(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._kv.pop(worker_id, None)

    async def workers(self) -> list[WorkerRecord]:
        live = [w for wid in sorted(self._workers) if (w := self._live_worker(wid)) is not None]
        return [WorkerRecord(w.info, w.load, w.last_seen) for w in live]

    async def publish_kv_events(self, worker_id: str, batch: KVEventBatch) -> int:
        state = self._live_kv(worker_id) or self._new_kv(worker_id)
        if state.last_seq is None:                    # new epoch: jump past every earlier seq
            last = self._last_seq_ever.get(worker_id, 0)
            state.last_seq = max(int(self._clock() * 1_000_000), last + 1)
            state.entries.clear()
            state.snapshot = None
        state.last_seq += 1
        self._last_seq_ever[worker_id] = state.last_seq
        state.entries.append((state.last_seq, encode_batch(batch)))
        while len(state.entries) > self._maxlen:
            state.entries.popleft()
        self._touch_kv(worker_id)
        return state.last_seq

    async def read_kv_events(self, worker_id: str, after: int = 0,
                             limit: int = DEFAULT_READ_LIMIT) -> list[tuple[int, KVEventBatch]]:
        check_read(after, limit)
        state = self._live_kv(worker_id)
        if state is None:
            return []
        picked = [(seq, data) for seq, data in state.entries if seq > after][:limit]
        return [(seq, decode_batch(data)) for seq, data in picked]

    async def write_kv_snapshot(self, worker_id: str, seq: int, block_hashes: list[int]) -> None:
        state = self._live_kv(worker_id) or self._new_kv(worker_id)
        state.snapshot = (seq, list(block_hashes))
        self._touch_kv(worker_id)

    async def read_kv_snapshot(self, worker_id: str) -> tuple[int, list[int]] | None:
        state = self._live_kv(worker_id)
        if state is None or state.snapshot is None:
            return None
        seq, hashes = state.snapshot
        return seq, list(hashes)

    async def instance_id(self) -> str | None:
        return f"memory-{id(self):x}"               # one process-local store: it never restarts

    async def share_router_load(self, router_id: str, loads: RouterLoads, ttl_s: float) -> dict[str, RouterLoads]:
        check_ttl(ttl_s)
        now = self._clock()
        self._router_loads[router_id] = (now, dict(loads))
        self._router_loads = {rid: e for rid, e in self._router_loads.items() if now - e[0] <= ttl_s}
        return {rid: dict(e[1]) for rid, e in self._router_loads.items() if rid != router_id}

    async def take_buckets(self, specs: Sequence[BucketSpec], force: bool = False) -> BucketResult:
        return self._buckets.take(specs, force)

    async def router_heartbeat(self, router_id: str, ttl_s: float) -> int:
        check_ttl(ttl_s)
        return self._buckets.router_heartbeat(router_id, ttl_s)

    async def close(self) -> None:
        return None

    def _live_worker(self, worker_id: str) -> _Worker | None:
        worker = self._workers.get(worker_id)
        if worker is not None and worker.expires_at <= self._clock():
            del self._workers[worker_id]
            return None
        return worker

    def _live_kv(self, worker_id: str) -> _KVState | None:
        state = self._kv.get(worker_id)
        if state is not None and state.expires_at <= self._clock():
            del self._kv[worker_id]
            return None
        return state

    def _new_kv(self, worker_id: str) -> _KVState:
        state = self._kv[worker_id] = _KVState(expires_at=self._clock() + self._retain_s)
        return state

    def _touch_kv(self, worker_id: str) -> None:
        state = self._live_kv(worker_id)
        if state is not None:
            state.expires_at = self._clock() + self._retain_s
