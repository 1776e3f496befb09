"""The router's registry against a store that restarts empty (issue 11): it keeps routing on the last
known fleet until workers have registered again (or a grace period ends), instead of a 503; an empty
list from the same store instance is real (every worker deregistered) and applies at once."""
from __future__ import annotations

import asyncio

import pytest

from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.store.memory import InMemoryStore
from shared.workers import WorkerInfo

pytestmark = pytest.mark.asyncio


class RestartableStore(InMemoryStore):
    """An in-memory store whose "server" can restart: empty, under a new instance id."""

    def __init__(self) -> None:
        super().__init__()
        self.run_id = 1

    async def instance_id(self) -> str | None:
        return str(self.run_id)

    def restart_empty(self) -> None:
        self._workers.clear()
        self.run_id += 1


def info(wid: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", url=f"http://127.0.0.1:9/{wid}", model_id="kimi-k3")


async def registry_with(store, *workers: str) -> WorkerRegistry:
    registry = WorkerRegistry(RouterSettings(model="m", store_url="memory://", store_empty_grace_s=0.3), store)
    for wid in workers:
        await store.register(info(wid), 5.0)
    await registry.refresh()
    assert sorted(registry.discovered) == sorted(workers)
    return registry


async def test_store_restarted_empty_keeps_the_last_fleet_until_repopulated():
    store = RestartableStore()
    registry = await registry_with(store, "d0", "d1")
    store.restart_empty()
    await registry.refresh()
    assert sorted(registry.discovered) == ["d0", "d1"] and registry.store_ok
    await store.register(info("d1"), 5.0)                   # the first heartbeat re-registers: store wins again
    await registry.refresh()
    assert sorted(registry.discovered) == ["d1"]
    store.restart_empty()
    await registry.refresh()
    await asyncio.sleep(0.35)                               # nobody comes back: after the grace, nobody
    await registry.refresh()
    assert registry.discovered == {}


async def test_every_worker_deregistering_from_the_same_store_applies_at_once():
    store = RestartableStore()
    registry = await registry_with(store, "d0")
    await store.deregister("d0")
    await registry.refresh()
    assert registry.discovered == {}
