"""Presence: a worker whose engine thread is stuck keeps its registration and says it is stuck; KV events
still reach the store once the engine is free."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core.engine import EngineConfig
from shared.sampling_params import SamplingParams
from shared.store.memory import InMemoryStore
from shared.workers import WorkerInfo
from tests.engine.core.helpers import SETTINGS, prompt_ids
from worker.presence import WorkerPresence

HEARTBEAT_S, TTL_S = 0.1, 0.5




@pytest.fixture()
def engine(tiny_dir):
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), **SETTINGS))
    yield eng
    eng.shutdown()


def _info() -> WorkerInfo:
    return WorkerInfo(worker_id="w0", role="decode", url="http://127.0.0.1:9", model_id="kimi-k3",
                      block_size=SETTINGS.get("block_size", 16))


def test_a_stuck_engine_keeps_its_registration_and_reports_how_long_it_is_busy(engine) -> None:
    store = InMemoryStore()
    release = threading.Event()

    async def main() -> list[float]:
        presence = WorkerPresence(store, _info(), engine, HEARTBEAT_S, TTL_S)
        presence.start()
        try:
            await asyncio.sleep(0.3)
            stuck = asyncio.ensure_future(engine.call(lambda: release.wait(10)))   # the engine thread blocks
            busy = []
            for _ in range(12):                                     # 1.8 s: more than three TTLs
                await asyncio.sleep(0.15)
                records = await store.workers()
                assert [r.info.worker_id for r in records] == ["w0"], "the stuck worker vanished"
                busy.append(records[0].load.engine_busy_s)
            release.set()
            await stuck
            await asyncio.sleep(0.3)
            after = (await store.workers())[0].load.engine_busy_s
            return [*busy, after]
        finally:
            await presence.stop()

    reports = asyncio.run(main())
    assert max(reports[:-1]) > 3 * TTL_S                             # it said how long it had been stuck
    assert reports[:-1] == sorted(reports[:-1])                      # ... and that grew while it was stuck
    assert reports[-1] < TTL_S                                       # back to normal once free


def test_kv_events_reach_the_store_after_the_engine_was_busy(engine) -> None:
    store = InMemoryStore()
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main() -> tuple[tuple[int, list[int]] | None, list]:
        presence = WorkerPresence(store, _info(), engine, HEARTBEAT_S, TTL_S)
        presence.start()
        try:
            await engine.call(lambda: time.sleep(0.5))
            async for _ in engine.generate("r0", prompt_ids(64, 3), greedy):
                pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                batches = await store.read_kv_events("w0")
                if any(batch.events for _, batch in batches):
                    break
                await asyncio.sleep(0.1)
            return await store.read_kv_snapshot("w0"), batches
        finally:
            await presence.stop()

    snapshot, batches = asyncio.run(main())
    assert snapshot is not None                                      # the snapshot a registration asks for
    assert any(batch.events for _, batch in batches)                 # the prompt's blocks were published
