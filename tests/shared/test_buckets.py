"""Token buckets in the state store: the Lua script and the in-process arithmetic agree, a request's
buckets are taken all or none, and two store clients (two router replicas) draw on one limit."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from shared.store import InMemoryStore, RedisStore
from shared.store.buckets import BucketSpec, LocalBuckets

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]
SLOW = 1e-6                                   # refills nothing within a test


def spec(name: str, cap: float, cost: float, rate: float = SLOW) -> BucketSpec:
    return BucketSpec(name, cap, rate, cost)


async def test_local_refill_wait_and_force() -> None:
    now = [0.0]
    b = LocalBuckets(lambda: now[0])
    assert b.take([spec("r", 10, 4, rate=1.0)]).levels == (6.0,)
    refused = b.take([spec("r", 10, 8, rate=1.0)])
    assert not refused.allowed and refused.wait_s == pytest.approx(2.0) and refused.levels == (6.0,)
    now[0] = 2.0
    assert b.take([spec("r", 10, 8, rate=1.0)]).allowed
    forced = b.take([spec("r", 10, 5, rate=1.0)], force=True)        # settling overdraws
    assert forced.allowed and forced.levels == (-5.0,)
    refund = b.take([spec("r", 10, -100, rate=1.0)], force=True)     # a refund never exceeds capacity
    assert refund.levels == (10.0,)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_all_or_none_then_same_levels_as_local(kind: str, redis_url: str) -> None:
    store = InMemoryStore() if kind == "memory" else RedisStore(redis_url, namespace=uuid.uuid4().hex)
    local = LocalBuckets()
    try:
        for costs in ((1, 100), (1, 950), (1, 900), (1, 50), (1, 0)):
            specs = [spec("req", 3, costs[0]), spec("tok", 1000, costs[1])]
            got, want = await store.take_buckets(specs), local.take(specs)
            assert got.allowed == want.allowed
            assert got.levels == pytest.approx(want.levels, abs=0.01)
        # the third (900 tokens) was refused and took no request either; the 5th has no request left
        assert [round(v) for v in (await store.take_buckets([spec("req", 3, 0)])).levels] == [0]
    finally:
        await store.close()


async def test_two_replicas_share_one_limit(redis_url: str) -> None:
    """200 concurrent takes through two clients of one namespace, 50 allowed: exactly 50 pass."""
    ns = uuid.uuid4().hex                     # generous timeouts: 200 connections open at once on a busy host
    a, b = RedisStore(redis_url, namespace=ns, op_timeout_s=5.0), RedisStore(redis_url, namespace=ns, op_timeout_s=5.0)
    try:
        results = await asyncio.gather(*(s.take_buckets([spec("t:rpm", 50, 1)]) for _ in range(100) for s in (a, b)))
        assert sum(r.allowed for r in results) == 50
        refused = [r for r in results if not r.allowed]
        assert all(r.wait_s > 0 for r in refused)
        assert await a.router_heartbeat("r1", 5.0) == 1
        assert await b.router_heartbeat("r2", 5.0) == 2
        assert await a.router_heartbeat("r1", 5.0) == 2
    finally:
        await a.close()
        await b.close()


async def test_store_cost_per_request(redis_url: str) -> None:
    """One take (two buckets) is one round trip: well under a millisecond of server work; the bound
    here only catches a pathological regression (e.g. a script reloaded per call) on a loaded host."""
    store = RedisStore(redis_url, namespace=uuid.uuid4().hex)
    try:
        specs = [spec("r", 1e9, 1, rate=1e6), spec("t", 1e9, 100, rate=1e6)]
        await store.take_buckets(specs)
        n, start = 200, time.perf_counter()
        for _ in range(n):
            await store.take_buckets(specs)
        per_call = (time.perf_counter() - start) / n
        assert per_call < 0.05, per_call
    finally:
        await store.close()
