"""No idle death: a TP engine left quiet longer than its collective timeout still serves (the
follower waits for commands on a clock of its own); a follower that exits is seen at once."""
from __future__ import annotations

import time

import pytest

from engine import LLM
from tests.engine.parallel.test_tensor_parallel import GREEDY, PROMPTS, SETTINGS

pytestmark = pytest.mark.timeout(180)


def test_an_idle_tp_engine_outlives_the_collective_timeout(tiny_dir, monkeypatch):
    monkeypatch.setenv("KIMI_PD_TP_TIMEOUT_S", "4")       # 120 s in production; the followers inherit it
    with LLM(str(tiny_dir), tensor_parallel_size=2, **SETTINGS) as llm:
        first = llm.generate(PROMPTS[:2], GREEDY)
        time.sleep(9)             # > 2 timeouts of silence: with one clock the follower had given up here
        assert llm.engine.tp.alive()
        again = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.output.token_ids for o in again] == [o.output.token_ids for o in first]


def test_a_follower_that_exits_is_seen(tiny_dir):
    with LLM(str(tiny_dir), tensor_parallel_size=2, **SETTINGS) as llm:
        assert llm.engine.tp.alive()
        llm.engine.tp.procs[0].kill()
        llm.engine.tp.procs[0].wait(10)
        assert not llm.engine.tp.alive()
