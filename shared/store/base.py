"""The state store shared by router replicas and workers: its contract, records and errors.

What it holds (nothing that the workers cannot rebuild after the server loses it):
  * registry: one `WorkerInfo` per live worker; it lives `ttl_s` after the last register/heartbeat;
  * load: the latest `LoadReport` and when it arrived (`last_seen`, wall-clock seconds);
  * KV events: one stream per worker of msgpack `KVEventBatch`es, each with a sequence number;
  * KV snapshot: the block hashes a worker held at one sequence number.

Sequence numbers (invariants every implementation keeps):
  * within one stream "epoch" they are consecutive: n, n+1, n+2, ...;
  * a new epoch (first publish after deregister, after the stream expired, after the server lost its
    data) starts strictly above every earlier number and never at last+1, so a consumer that sees
    anything but last+1 knows it missed events; starting an epoch drops the old snapshot.
Seeding: after (re-)registering, a worker publishes a batch (may be empty) and writes its snapshot at
the returned seq. A late router reads the snapshot at S, then events after S; if the first one is
not S+1 (the stream was trimmed or restarted) it waits for a fresher snapshot.

Redis key layout (P = "kimipd:{namespace}"; TTLs in ms, set with PX/PEXPIRE):
  P:worker:{id}     string  msgpack WorkerInfo dict                  PX ttl_s, refreshed by heartbeat
  P:load:{id}       string  msgpack {"load": LoadReport, "last_seen"} PX ttl_s, rewritten by heartbeat
  P:workers         zset    worker id -> expiry (unix s, client clock) no TTL; entries older than
                            PRUNE_GRACE_S past expiry are removed on listing. A superset of the live
                            workers: the P:worker key is the truth.
  P:events:{id}     stream  ids "{seq}-0", field b=msgpack KVEventBatch; XADD MAXLEN ~ events_maxlen;
                            PX retain_s, refreshed by publish, heartbeat and snapshot writes
  P:seq:{id}        string  last seq of the current epoch (INCR)       PX retain_s, as the stream
  P:snapshot:{id}   string  msgpack [seq, [block hashes]]             PX retain_s, as the stream
deregister deletes every key of the worker. An epoch's first seq is the server's TIME in microseconds
plus one (Lua numbers are doubles: exact below 2**53).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.kv_events import KVEventBatch
from shared.workers import LoadReport, WorkerInfo

KEY_PREFIX = "kimipd"
DEFAULT_EVENTS_MAXLEN = 10_000       # batches kept per worker stream (approximate in Redis)
DEFAULT_RETAIN_S = 600.0             # events/snapshot of a worker that stops heartbeating
DEFAULT_READ_LIMIT = 1_000
PRUNE_GRACE_S = 60.0                 # tolerated client clock skew when pruning the worker index


class StoreError(Exception):
    """Base class of state store errors."""


class StoreUnavailable(StoreError):
    """The store's server could not be reached or did not answer within the store's timeouts."""


@dataclass(frozen=True)
class WorkerRecord:
    """One live worker as listed by `StateStore.workers()`."""

    info: WorkerInfo
    load: LoadReport
    last_seen: float                 # wall-clock seconds of the latest register/heartbeat


@runtime_checkable
class StateStore(Protocol):
    """Async shared state. Every method may raise `StoreUnavailable`, quickly, never hanging."""

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Write `info` with an empty load; the worker is listed until `ttl_s` without heartbeat."""
        ...

    async def heartbeat(self, worker_id: str, load: LoadReport, ttl_s: float) -> bool:
        """Refresh the registration's TTL and store `load`.

        Returns False (and keeps nothing listed) if the registration is gone, e.g. it expired or the
        server restarted: the worker must then `register` again and re-seed its KV snapshot.
        """
        ...

    async def deregister(self, worker_id: str) -> None:
        """Remove the worker and all its keys (registry, load, events, snapshot). Idempotent."""
        ...

    async def workers(self) -> list[WorkerRecord]:
        """Live workers, sorted by worker id."""
        ...

    async def publish_kv_events(self, worker_id: str, batch: KVEventBatch) -> int:
        """Append `batch` to the worker's stream; returns its sequence number (see module doc)."""
        ...

    async def read_kv_events(self, worker_id: str, after: int = 0,
                             limit: int = DEFAULT_READ_LIMIT) -> list[tuple[int, KVEventBatch]]:
        """Up to `limit` retained batches with seq > `after`, in seq order."""
        ...

    async def write_kv_snapshot(self, worker_id: str, seq: int, block_hashes: list[int]) -> None:
        """Replace the worker's snapshot: the blocks it held right after batch `seq`."""
        ...

    async def read_kv_snapshot(self, worker_id: str) -> tuple[int, list[int]] | None:
        """The latest snapshot as (seq, block hashes), or None if there is none."""
        ...

    async def instance_id(self) -> str | None:
        """An id of the running store server that changes when it restarts (None: unknown)."""
        ...

    async def share_router_load(self, router_id: str, loads: RouterLoads, ttl_s: float) -> dict[str, RouterLoads]:
        """Publish one router replica's load per static worker (kept `ttl_s`) and return the other live
        replicas' (router id -> theirs): static workers report to no store, so replicas share what they sent."""
        ...

    async def close(self) -> None:
        """Release connections. The store must not be used afterwards."""
        ...


# a router replica's view of what it sent each static worker: worker id -> [in-flight legs, open work (s)]
RouterLoads = dict[str, list[float]]


def check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")


def check_read(after: int, limit: int) -> None:
    if after < 0:
        raise ValueError(f"after must be >= 0, got {after}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
