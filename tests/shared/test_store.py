"""State store: one behavioural suite over InMemoryStore and RedisStore, then Redis faults and the
embedded server's lifecycle. Time moves by a fake clock (memory) or real sleeps (Redis)."""
from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from shared.net import free_port
from shared.store import (
    EmbeddedValkey,
    InMemoryStore,
    RedisStore,
    StateStore,
    StoreUnavailable,
    make_store,
)
from shared.store.embedded import EmbeddedValkeyError, find_server_binary
from shared.workers import LoadReport, WorkerInfo

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]
TTL = 1.0
H64 = 2**64 - 1                               # block hashes are unsigned 64-bit


def info(wid: str = "w1", role: str = "prefill") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, url=f"http://127.0.0.1:1/{wid}", model_id="m",  # type: ignore[arg-type]
                      transfer_port=7, hash_root=H64)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockStored([i, H64], i - 1, [i, i + 1], 2), BlockRemoved([i])])


class Harness:
    """Opens stores that share state per namespace (two opens = two router replicas) and moves time."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.kind, self._url, self.now = kind, redis_url, 1_000.0
        self._base = uuid.uuid4().hex[:12]
        self._memory: dict[str, InMemoryStore] = {}
        self._opened: list[StateStore] = []

    def open(self, namespace: str = "a", **options: Any) -> StateStore:
        if self.kind == "memory":
            key = f"{namespace}{sorted(options.items())}"
            return self._memory.setdefault(key, InMemoryStore(clock=lambda: self.now, **options))
        store = RedisStore(self._url or "", namespace=f"{self._base}-{namespace}", **options)
        self._opened.append(store)
        return store

    async def advance(self, seconds: float) -> None:
        if self.kind == "memory":
            self.now += seconds
        else:
            await asyncio.sleep(seconds)

    async def close(self) -> None:
        for store in self._opened:
            await store.close()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    h = Harness(request.param, url)
    yield h
    await h.close()


# ---- registry -------------------------------------------------------------------------------------

async def test_register_then_list(harness: Harness) -> None:
    store = harness.open()
    assert isinstance(store, StateStore)
    assert await store.workers() == []
    await store.register(info("w2", "decode"), TTL)
    await store.register(info("w1"), TTL)
    records = await store.workers()
    assert [r.info for r in records] == [info("w1"), info("w2", "decode")]
    assert records[0].load == LoadReport()
    assert abs(records[0].last_seen - (harness.now if harness.kind == "memory" else time.time())) < 5


async def test_heartbeat_extends_registration_and_kv_retention(harness: Harness) -> None:
    store = harness.open(retain_s=TTL)
    await store.register(info(), TTL)
    seq = await store.publish_kv_events("w1", batch(1))
    first_seen = (await store.workers())[0].last_seen
    await harness.advance(0.6 * TTL)
    load = LoadReport(running=3, waiting=1, cache_usage=0.25, extra={"k": [1, 2]})
    assert await store.heartbeat("w1", load, TTL) is True
    await harness.advance(0.6 * TTL)               # 1.2 TTL after register, 0.6 after heartbeat
    [record] = await store.workers()
    assert record.load == load and record.last_seen > first_seen
    assert await store.read_kv_events("w1") == [(seq, batch(1))]
    await harness.advance(0.6 * TTL)
    assert await store.workers() == [] and await store.read_kv_events("w1") == []


async def test_expired_worker_must_register_again(harness: Harness) -> None:
    store = harness.open()
    await store.register(info(), TTL / 2)
    await harness.advance(0.7 * TTL)
    assert await store.workers() == []
    assert await store.heartbeat("w1", LoadReport(running=1), TTL) is False
    assert await store.workers() == []             # a failed heartbeat does not resurrect it
    await store.register(info(), TTL)
    assert await store.heartbeat("w1", LoadReport(running=1), TTL) is True
    assert [r.load.running for r in await store.workers()] == [1]


async def test_deregister_removes_worker_and_kv_state(harness: Harness) -> None:
    store = harness.open()
    await store.register(info("w1"), TTL)
    await store.register(info("w2"), TTL)
    seq = await store.publish_kv_events("w1", batch(1))
    await store.write_kv_snapshot("w1", seq, [1])
    await store.deregister("w1")
    await store.deregister("w1")                   # idempotent
    assert [r.info.worker_id for r in await store.workers()] == ["w2"]
    assert await store.read_kv_events("w1") == [] and await store.read_kv_snapshot("w1") is None
    assert await store.heartbeat("w1", LoadReport(), TTL) is False


async def test_invalid_arguments(harness: Harness) -> None:
    store = harness.open()
    with pytest.raises(ValueError):
        await store.register(info(), 0)
    with pytest.raises(ValueError):
        await store.read_kv_events("w1", after=-1)
    with pytest.raises(ValueError):
        await store.read_kv_events("w1", limit=0)


# ---- KV events and snapshots ----------------------------------------------------------------------

async def test_events_are_consecutive_and_read_after(harness: Harness) -> None:
    store = harness.open()
    seqs = [await store.publish_kv_events("w1", batch(i)) for i in range(5)]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    assert await store.read_kv_events("w1") == [(s, batch(i)) for i, s in enumerate(seqs)]
    assert await store.read_kv_events("w1", after=seqs[1]) == [(s, batch(i)) for i, s in enumerate(seqs)][2:]
    assert [s for s, _ in await store.read_kv_events("w1", after=seqs[0], limit=2)] == seqs[1:3]
    assert await store.read_kv_events("w1", after=seqs[-1]) == []
    assert await store.read_kv_events("w2") == []
    empty = KVEventBatch(ts=9.0, events=[AllBlocksCleared()], data_parallel_rank=3)
    last = await store.publish_kv_events("w1", empty)
    assert await store.read_kv_events("w1", after=seqs[-1]) == [(seqs[-1] + 1, empty)] and last == seqs[-1] + 1


async def test_new_epoch_jumps_and_drops_stale_snapshot(harness: Harness) -> None:
    store = harness.open()
    await store.write_kv_snapshot("w1", 0, [1])   # before any publish: no epoch, so never valid
    old = await store.publish_kv_events("w1", batch(1))
    assert await store.read_kv_snapshot("w1") is None
    await store.write_kv_snapshot("w1", old, [1, 2])
    await store.deregister("w1")
    new = await store.publish_kv_events("w1", batch(2))
    assert new > old + 1                           # a consumer at `old` sees a gap, never a fake next
    assert await store.read_kv_events("w1") == [(new, batch(2))]


async def test_stream_is_trimmed_to_about_maxlen(harness: Harness) -> None:
    store = harness.open(events_maxlen=10)
    seqs = [await store.publish_kv_events("w1", batch(0)) for _ in range(250)]
    kept = [s for s, _ in await store.read_kv_events("w1", limit=1000)]
    assert 10 <= len(kept) < 250 and kept == list(range(kept[0], seqs[-1] + 1))


async def test_snapshot_round_trip_and_replace(harness: Harness) -> None:
    store = harness.open()
    assert await store.read_kv_snapshot("w1") is None
    await store.write_kv_snapshot("w1", 7, [H64, 0, 5])
    assert await store.read_kv_snapshot("w1") == (7, [H64, 0, 5])
    await store.write_kv_snapshot("w1", 9, [])
    assert await store.read_kv_snapshot("w1") == (9, [])


async def test_late_router_rebuilds_from_snapshot_plus_stream(harness: Harness) -> None:
    worker, router = harness.open(), harness.open()
    seqs = [await worker.publish_kv_events("w1", batch(i)) for i in range(3)]
    await worker.write_kv_snapshot("w1", seqs[-1], [0, 1, 2])
    tail = [await worker.publish_kv_events("w1", batch(i)) for i in (3, 4)]
    snap = await router.read_kv_snapshot("w1")
    assert snap == (seqs[-1], [0, 1, 2])
    events = await router.read_kv_events("w1", after=snap[0])
    assert events == [(tail[0], batch(3)), (tail[1], batch(4))] and tail[0] == snap[0] + 1


async def test_two_clients_see_the_same_state(harness: Harness) -> None:
    a, b = harness.open("shared"), harness.open("shared")
    await a.register(info("w1"), TTL)
    assert await b.heartbeat("w1", LoadReport(held=2), TTL) is True
    assert [(r.info, r.load.held) for r in await a.workers()] == [(info("w1"), 2)]
    seq = await b.publish_kv_events("w1", batch(1))
    assert await a.read_kv_events("w1") == [(seq, batch(1))]
    await a.deregister("w1")
    assert await b.workers() == []


async def test_namespaces_are_isolated(harness: Harness) -> None:
    x, y = harness.open("x"), harness.open("y")
    await x.register(info(), TTL)
    await x.publish_kv_events("w1", batch(1))
    await x.write_kv_snapshot("w1", 1, [1])
    assert await y.workers() == [] and await y.read_kv_events("w1") == []
    assert await y.read_kv_snapshot("w1") is None
    await y.deregister("w1")
    assert len(await x.workers()) == 1


# ---- factory, Redis key layout, faults ------------------------------------------------------------

async def test_make_store_by_url(redis_url: str, tmp_path: Path) -> None:
    assert isinstance(make_store(None, "n"), InMemoryStore) and isinstance(make_store("memory://", "n"), InMemoryStore)
    with pytest.raises(ValueError):
        make_store("http://127.0.0.1:1", "n")
    with EmbeddedValkey(unix_socket=tmp_path / "v.sock") as server:
        for url in (redis_url, server.url):
            store = make_store(url, uuid.uuid4().hex, op_timeout_s=0.5)
            assert isinstance(store, RedisStore)
            await store.register(info(), 30)
            assert [r.info for r in await store.workers()] == [info()]
            await store.close()


async def test_redis_keys_are_namespaced_and_expire(redis_url: str) -> None:
    ns = uuid.uuid4().hex
    store, raw = RedisStore(redis_url, ns), aioredis.Redis.from_url(redis_url)
    await store.register(info(), 30)
    await store.write_kv_snapshot("w1", await store.publish_kv_events("w1", batch(1)), [1])
    p = f"kimipd:{{{ns}}}"
    keys = {k.decode() async for k in raw.scan_iter(match=f"{p}:*")}
    assert keys == {f"{p}:{k}" for k in ("worker:w1", "load:w1", "workers", "events:w1", "seq:w1", "snapshot:w1")}
    assert all([0 < await raw.pttl(k) <= 600_000 for k in keys - {f"{p}:workers"}])
    await raw.aclose()
    await store.close()


@pytest.fixture
def server() -> Any:
    with EmbeddedValkey() as srv:
        yield srv


async def fails_fast(call: Any, limit_s: float = 2.0) -> None:
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await call
    assert time.monotonic() - start < limit_s


async def test_down_or_hung_server_fails_fast_then_recovers(server: EmbeddedValkey) -> None:
    store = RedisStore(server.url, "f", op_timeout_s=0.5)
    await store.register(info(), 30)
    server.pause()                                 # accepts connections, never answers
    try:
        await fails_fast(store.workers())
    finally:
        server.resume()
    assert len(await store.workers()) == 1
    server.stop()
    for call in (store.register(info(), 30), store.heartbeat("w1", LoadReport(), 30), store.workers(),
                 store.deregister("w1"), store.publish_kv_events("w1", batch(1)), store.read_kv_events("w1"),
                 store.write_kv_snapshot("w1", 1, []), store.read_kv_snapshot("w1")):
        await fails_fast(call)
    server.start()                                 # same port, empty data, same store object
    assert await store.workers() == []
    await store.register(info(), 30)
    assert [r.info for r in await store.workers()] == [info()]
    await store.close()


async def test_heartbeat_reports_lost_registration_after_restart(server: EmbeddedValkey) -> None:
    worker, router = RedisStore(server.url, "f"), RedisStore(server.url, "f")
    await worker.register(info(), 30)
    old = await worker.publish_kv_events("w1", batch(1))
    await worker.write_kv_snapshot("w1", old, [1])
    server.restart()
    assert os.listdir(server.data_dir) == ["valkey.log"]          # nothing persisted
    assert await worker.heartbeat("w1", LoadReport(), 30) is False
    assert await router.workers() == [] and await router.read_kv_snapshot("w1") is None
    await worker.register(info(), 30)              # the worker's reaction: re-register and re-seed
    new = await worker.publish_kv_events("w1", KVEventBatch(ts=2.0))
    assert new > old + 1
    await worker.write_kv_snapshot("w1", new, [1])
    assert await worker.heartbeat("w1", LoadReport(running=1), 30) is True
    assert [r.load.running for r in await router.workers()] == [1]
    assert await router.read_kv_snapshot("w1") == (new, [1])
    await worker.close()
    await router.close()


async def test_credentials_stay_out_of_reprs_and_errors() -> None:
    store = RedisStore(f"redis://kimi:s3cret@127.0.0.1:{free_port()}/0", "c", op_timeout_s=0.5)
    with pytest.raises(StoreUnavailable) as err:
        await store.workers()
    assert "s3cret" not in repr(store) and "s3cret" not in str(err.value)
    await store.close()



# ---- embedded server lifecycle (blocking calls) ---------------------------------------------------

def process_gone(pid: int | None, within_s: float = 3.0) -> bool:
    """True once `pid` no longer exists or is a zombie (an orphan's reaper may be slow)."""
    deadline = time.monotonic() + within_s
    while pid is not None and time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


async def test_embedded_leaves_no_files_or_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError), EmbeddedValkey() as srv:
        pid, data_dir = srv.pid, srv.data_dir
        raise RuntimeError("boom")
    assert process_gone(pid) and data_dir is not None and not os.path.exists(data_dir)
    assert list(tmp_path.iterdir()) == []
    srv = EmbeddedValkey().start()
    pid = srv.pid
    del srv
    gc.collect()                                   # the finaliser stops an unreferenced server
    assert process_gone(pid)


async def test_embedded_server_dies_with_a_killed_owner() -> None:
    code = ("from shared.store import EmbeddedValkey; s = EmbeddedValkey().start(); "
            "print(s.pid, s.data_dir, flush=True); input()")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             cwd=Path(__file__).parents[2], text=True)
    data_dir = ""
    try:
        pid, data_dir = owner.stdout.readline().split()   # type: ignore[union-attr]
        owner.send_signal(signal.SIGKILL)
        assert process_gone(int(pid))
    finally:
        owner.kill()
        owner.wait(5)
        shutil.rmtree(data_dir, ignore_errors=True)  # a SIGKILLed owner cannot clean up after itself



async def test_binary_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = find_server_binary()
    monkeypatch.setenv("KIMIPD_VALKEY_SERVER", str(tmp_path / "missing"))
    with pytest.raises(EmbeddedValkeyError):       # a pinned binary is never silently replaced
        find_server_binary()
    assert find_server_binary(found) == found
