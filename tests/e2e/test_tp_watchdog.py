"""A worker whose engine died exits (code 70) so supervision restarts it, instead of staying up
answering 503 engine_dead: also when the dead part is a tensor-parallel follower rank (the watchdog's
decisions here; a real TP worker whose follower is SIGKILLed: tests/faults/test_tp_follower_death.py)."""
from __future__ import annotations

import asyncio

import pytest

from worker.watchdog import EXIT_ENGINE_DEAD, watch_engine

pytestmark = pytest.mark.timeout(240)


class FakeEngine:
    def __init__(self, tp) -> None:
        self.engine, self._dead = type("E", (), {"tp": tp})(), None

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def failed(self) -> bool:
        return self._dead is not None

    def mark_dead(self, exc: BaseException) -> None:
        self._dead = exc


class FakeRuntime:
    def __init__(self, engine) -> None:
        self.engine, self.presence, self.draining = engine, None, False


def test_watchdog_exits_when_a_rank_goes_and_not_before():
    class TP:
        up = True

        def alive(self) -> bool:
            return self.up

    tp, exits = TP(), []
    runtime = FakeRuntime(FakeEngine(tp))

    async def scenario():
        task = asyncio.create_task(watch_engine(runtime, interval_s=0.01, grace_s=0.01, exit_fn=exits.append))
        await asyncio.sleep(0.1)
        assert exits == [] and not runtime.engine.is_dead
        tp.up = False
        await asyncio.wait_for(task, 2)
    asyncio.run(scenario())
    assert exits == [EXIT_ENGINE_DEAD] and runtime.engine.is_dead


def test_watchdog_stands_down_while_draining():
    runtime, exits = FakeRuntime(FakeEngine(None)), []
    runtime.draining = True
    asyncio.run(watch_engine(runtime, interval_s=0.01, exit_fn=exits.append))
    assert exits == []


def test_watchdog_leaves_a_deliberately_shut_down_engine_alone(tmp_path, e2e_model):
    from engine.async_engine import AsyncEngine
    from engine.core.engine import EngineConfig
    engine = AsyncEngine(EngineConfig(model=str(e2e_model), block_size=4, kda_chunk_size=8, cache_memory_bytes=8 << 20))
    engine.shutdown()
    assert engine.is_dead and not engine.failed
    exits: list[int] = []

    async def scenario():
        task = asyncio.create_task(watch_engine(FakeRuntime(engine), interval_s=0.01, exit_fn=exits.append))
        await asyncio.sleep(0.2)
        task.cancel()
    asyncio.run(scenario())
    assert exits == []
