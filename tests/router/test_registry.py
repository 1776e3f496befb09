"""The router's registry against a store that restarts empty (issue 11): it keeps routing on the last
known fleet until workers have registered again (or a grace period ends), instead of a 503."""
from __future__ import annotations

import asyncio

import pytest

from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.store.memory import InMemoryStore
from shared.workers import WorkerInfo

pytestmark = pytest.mark.asyncio


def info(wid: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", url=f"http://127.0.0.1:9/{wid}", model_id="kimi-k3")


async def test_store_restarted_empty_keeps_the_last_fleet_until_repopulated():
    store = InMemoryStore()
    registry = WorkerRegistry(RouterSettings(model="m", store_url="memory://", store_empty_grace_s=0.3), store)
    await store.register(info("d0"), 5.0)
    await store.register(info("d1"), 5.0)
    await registry.refresh()
    assert sorted(registry.discovered) == ["d0", "d1"]
    for wid in ("d0", "d1"):                                # the store restarts empty
        await store.deregister(wid)
    await registry.refresh()
    assert sorted(registry.discovered) == ["d0", "d1"] and registry.store_ok
    await store.register(info("d1"), 5.0)                   # the first heartbeat re-registers: store wins again
    await registry.refresh()
    assert sorted(registry.discovered) == ["d1"]
    await store.deregister("d1")
    await registry.refresh()
    await asyncio.sleep(0.35)                               # nobody comes back: after the grace, nobody
    await registry.refresh()
    assert registry.discovered == {}
