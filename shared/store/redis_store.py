"""`RedisStore`: the state store on a Redis/Valkey server, shared by router replicas and workers.

Key layout and TTLs: see `shared.store.base`. The namespace sits in braces (`kimipd:{ns}:...`), a
Redis Cluster hash tag, so one namespace's keys share a slot and multi-key scripts stay legal.
One connection pool per store, created once; it reconnects by itself after the server restarts.
Every call is bounded: socket connect/read timeouts of `op_timeout_s`, one immediate reconnect retry,
and a hard deadline; failures to reach the server raise `StoreUnavailable`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT, StreamRangeResponse

from shared.kv_events import KVEventBatch, decode_batch, encode_batch
from shared.redact import redact_url
from shared.store.base import (
    DEFAULT_EVENTS_MAXLEN,
    DEFAULT_READ_LIMIT,
    DEFAULT_RETAIN_S,
    KEY_PREFIX,
    PRUNE_GRACE_S,
    RouterLoads,
    StoreError,
    StoreUnavailable,
    WorkerRecord,
    check_read,
    check_ttl,
)
from shared.store.buckets import ROUTERS_LUA, TAKE_LUA, BucketResult, BucketSpec, check_specs, take_args
from shared.workers import LoadReport, WorkerInfo

log = logging.getLogger(__name__)
T = TypeVar("T")
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)

# KEYS: worker, load, index, events, seq, snapshot. ARGV: ttl_ms, load, worker_id, expiry, retain_ms.
_HEARTBEAT_LUA = """
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
for i = 4, 6 do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
return 1
"""

# KEYS: events, seq, snapshot. ARGV: batch, maxlen, retain_ms. A missing seq key starts an epoch at
# the server's TIME in microseconds (below 2**53, so exact as a Lua double) and drops stale data.
_PUBLISH_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  local t = redis.call('TIME')
  redis.call('DEL', KEYS[1], KEYS[3])
  redis.call('SET', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
end
local seq = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], string.format('%.0f-0', seq), 'b', ARGV[1])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return seq
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj)


def _bytes(value: object) -> bytes:
    """A reply value as bytes: redis-py types replies for both decode modes, and this client never
    decodes (`decode_responses=False`), so anything else is a malformed reply."""
    if not isinstance(value, bytes):
        raise TypeError(f"expected bytes from the state store, got {type(value).__name__}")
    return value


def _unpack(data: object) -> Any:
    return msgpack.unpackb(_bytes(data), strict_map_key=False)


def _event_rows(rows: StreamRangeResponse | None) -> list[tuple[int, KVEventBatch]]:
    """(seq, batch) of each stream entry (entry ids are `<seq>-0`)."""
    if rows is None:
        raise TypeError("the state store answered XRANGE with nothing")
    out = []
    for entry_id, fields in rows:
        if fields is None:
            raise TypeError(f"kv event entry {entry_id!r} has no fields")
        out.append((int(_bytes(entry_id).split(b"-", 1)[0]), decode_batch(_bytes(fields[b"b"]))))
    return out


class _Keys:
    def __init__(self, namespace: str) -> None:
        self.prefix = f"{KEY_PREFIX}:{{{namespace}}}"
        self.index = f"{self.prefix}:workers"

    def worker(self, wid: str) -> str:
        return f"{self.prefix}:worker:{wid}"

    def load(self, wid: str) -> str:
        return f"{self.prefix}:load:{wid}"

    def events(self, wid: str) -> str:
        return f"{self.prefix}:events:{wid}"

    def seq(self, wid: str) -> str:
        return f"{self.prefix}:seq:{wid}"

    def snapshot(self, wid: str) -> str:
        return f"{self.prefix}:snapshot:{wid}"

    @property
    def router_load(self) -> str:
        return f"{self.prefix}:router-load"

    def kv(self, wid: str) -> list[str]:
        return [self.events(wid), self.seq(wid), self.snapshot(wid)]


class RedisStore:
    """A `StateStore` on Redis/Valkey (`redis://`, `rediss://` or `unix://` URL)."""

    def __init__(self, url: str, namespace: str = "default", op_timeout_s: float = 0.5,
                 events_maxlen: int = DEFAULT_EVENTS_MAXLEN, retain_s: float = DEFAULT_RETAIN_S) -> None:
        self._where = redact_url(url)
        self._keys = _Keys(namespace)
        self._maxlen = events_maxlen
        self._retain_ms = _ms(retain_s)
        # One reconnect retry without backoff: a pooled connection the server closed (restart) is
        # replaced at once; a server that is down fails fast (refused: ~ms; silent: 2 x op_timeout_s).
        # The deadline caps a whole call, two round trips included (2.0 s at the default 0.5 s).
        self._deadline_s = 3 * op_timeout_s + 0.5
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s,
            retry=Retry(NoBackoff(), 1), protocol=2, decode_responses=False)
        self._heartbeat_script = self._redis.register_script(_HEARTBEAT_LUA)
        self._publish_script = self._redis.register_script(_PUBLISH_LUA)
        self._take_script = self._redis.register_script(TAKE_LUA)
        self._routers_script = self._redis.register_script(ROUTERS_LUA)
        self._reachable = True

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, prefix={self._keys.prefix!r})"

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        info.validate()                                # what routers will accept, checked at the source
        now, wid, ms = time.time(), info.worker_id, _ms(ttl_s)

        async def op() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.worker(wid), _pack(info.to_dict()), px=ms)
                pipe.set(self._keys.load(wid), _pack({"load": LoadReport().to_dict(), "last_seen": now}), px=ms)
                pipe.zadd(self._keys.index, {wid: now + ttl_s})
                await pipe.execute()
        await self._run("register", op)

    async def heartbeat(self, worker_id: str, load: LoadReport, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        now, k = time.time(), self._keys
        keys = [k.worker(worker_id), k.load(worker_id), k.index, *k.kv(worker_id)]
        args: list[EncodableT] = [_ms(ttl_s), _pack({"load": load.to_dict(), "last_seen": now}), worker_id,
                                  repr(now + ttl_s), self._retain_ms]
        return bool(await self._run("heartbeat", lambda: self._heartbeat_script(keys, args)))

    async def deregister(self, worker_id: str) -> None:
        k = self._keys

        async def op() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(k.worker(worker_id), k.load(worker_id), *k.kv(worker_id))
                pipe.zrem(k.index, worker_id)
                await pipe.execute()
        await self._run("deregister", op)

    async def workers(self) -> list[WorkerRecord]:
        return await self._run("workers", self._list_workers)

    async def publish_kv_events(self, worker_id: str, batch: KVEventBatch) -> int:
        args: list[EncodableT] = [encode_batch(batch), self._maxlen, self._retain_ms]
        seq = await self._run("publish_kv_events", lambda: self._publish_script(self._keys.kv(worker_id), args))
        return int(seq)

    async def read_kv_events(self, worker_id: str, after: int = 0,
                             limit: int = DEFAULT_READ_LIMIT) -> list[tuple[int, KVEventBatch]]:
        check_read(after, limit)
        rows = await self._run("read_kv_events", lambda: self._redis.xrange(
            self._keys.events(worker_id), min=f"{after + 1}-0", max="+", count=limit))
        return _event_rows(rows)

    async def write_kv_snapshot(self, worker_id: str, seq: int, block_hashes: list[int]) -> None:
        k, ms = self._keys, self._retain_ms

        async def op() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(k.snapshot(worker_id), _pack([seq, list(block_hashes)]), px=ms)
                pipe.pexpire(k.events(worker_id), ms)
                pipe.pexpire(k.seq(worker_id), ms)
                await pipe.execute()
        await self._run("write_kv_snapshot", op)

    async def read_kv_snapshot(self, worker_id: str) -> tuple[int, list[int]] | None:
        data = await self._run("read_kv_snapshot", lambda: self._redis.get(self._keys.snapshot(worker_id)))
        if data is None:
            return None
        seq, hashes = _unpack(data)
        return int(seq), list(hashes)

    async def instance_id(self) -> str | None:
        info = await self._run("instance_id", lambda: self._redis.info("server"))
        return str(info.get("run_id")) if isinstance(info, dict) and info.get("run_id") else None

    async def share_router_load(self, router_id: str, loads: RouterLoads, ttl_s: float) -> dict[str, RouterLoads]:
        """One round trip: this replica's entry (with its time) written, every replica's read; entries older
        than `ttl_s` (a replica that stopped) are dropped from the answer and deleted."""
        check_ttl(ttl_s)
        now, key = time.time(), self._keys.router_load

        async def op() -> dict[bytes, bytes]:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, router_id, _pack({"at": now, "loads": loads}))
                pipe.pexpire(key, _ms(10 * ttl_s))          # a namespace no replica uses any more clears itself
                pipe.hgetall(key)
                _, _, entries = await pipe.execute()
            return entries
        others, stale = {}, []
        for field_, raw in (await self._run("share_router_load", op)).items():
            rid, entry = _bytes(field_).decode(), _unpack(raw)
            if now - float(entry["at"]) > ttl_s:
                stale.append(rid)
            elif rid != router_id:
                others[rid] = dict(entry["loads"])
        if stale:
            await self._run("share_router_load", lambda: self._redis.hdel(key, *stale))
        return others

    async def take_buckets(self, specs: Sequence[BucketSpec], force: bool = False) -> BucketResult:
        """Tenant rate limits shared by every router (`shared.store.buckets`): one script, atomic."""
        check_specs(specs)
        keys = [f"{self._keys.prefix}:bucket:{s.name}" for s in specs]
        reply = await self._run("take_buckets", lambda: self._take_script(keys, take_args(specs, force)))
        values = [_bytes(v) if not isinstance(v, int) else str(v).encode() for v in reply]
        return BucketResult(values[0] == b"1", float(values[1]) / 1000, tuple(float(v) for v in values[2:]))

    async def router_heartbeat(self, router_id: str, ttl_s: float) -> int:
        """Say this router replica is alive; returns how many are (rate limits split 1/N without the store)."""
        check_ttl(ttl_s)
        key = f"{self._keys.prefix}:routers"
        return int(await self._run("router_heartbeat", lambda: self._routers_script([key], [router_id, _ms(ttl_s)])))

    async def close(self) -> None:
        await self._redis.aclose()

    async def _list_workers(self) -> list[WorkerRecord]:
        k = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(k.index, "-inf", time.time() - PRUNE_GRACE_S)
            pipe.zrange(k.index, 0, -1)
            _, raw_ids = await pipe.execute()
        ids = sorted(i.decode() for i in raw_ids)
        if not ids:
            return []
        values = await self._redis.mget([k.worker(i) for i in ids] + [k.load(i) for i in ids])
        records = []
        for info_raw, load_raw in zip(values[:len(ids)], values[len(ids):], strict=True):
            if info_raw is None:                   # expired or deregistered: the key is the truth
                continue
            try:                                   # one bad record (not written by a worker) is skipped, not fatal
                load: dict[str, Any] = (_unpack(load_raw) if load_raw is not None
                                        else {"load": {}, "last_seen": 0.0})
                records.append(WorkerRecord(WorkerInfo.from_dict(_unpack(info_raw)),
                                            LoadReport.from_dict(load["load"]), float(load["last_seen"])))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("state store: skipped a malformed worker record (%s: %s)", type(exc).__name__, exc)
        return records

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` under the deadline; map unreachable-server errors to `StoreUnavailable`."""
        try:
            async with asyncio.timeout(self._deadline_s):
                result = await call()
        except _UNREACHABLE as exc:
            if self._reachable:
                log.warning("state store %s unreachable (%s: %s)", self._where, op, type(exc).__name__)
            self._reachable = False
            raise StoreUnavailable(f"{op}: state store {self._where} unreachable: {exc!r}") from exc
        except RedisError as exc:            # OOM, READONLY after a failover, MISCONF...: the store is unusable now
            raise StoreError(f"{op}: state store {self._where} refused: {type(exc).__name__}") from exc
        except (ValueError, KeyError, TypeError) as exc:     # a malformed record written by someone else
            raise StoreError(f"{op}: malformed data in the state store: {type(exc).__name__}") from exc
        if not self._reachable:
            log.info("state store %s reachable again", self._where)
            self._reachable = True
        return result
