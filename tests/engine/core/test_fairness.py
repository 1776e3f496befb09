"""One request's fan-out (n x prompts: one group) holds at most its share of the batch while another
request waits: the other request is admitted within a step or two of arriving, not after the whole
fan-out, and no sequence's tokens change for it (preempted sequences are recomputed)."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from engine import SamplingParams
from engine.core.inputs import EngineInput
from engine.core.request import RequestStatus
from engine.core.scheduler import fair_order, fair_victim
from tests.engine.core.helpers import assert_clean, make_llm, prompt_ids

FAN_OUT = 24                      # sequences of the big request; max_num_seqs is 8
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)


def _run(tiny_dir, share: float) -> tuple[int, dict[str, list[int]], int]:
    """The fan-out goes in first and runs two steps, then the other request arrives: the steps until the
    other request runs, every request's tokens, and the preemptions."""
    llm = make_llm(tiny_dir, request_share=share)
    engine = llm.engine
    for i in range(FAN_OUT):
        params = SEEDED.for_sequence(i) if i % 2 else PARAMS
        engine.add_request(f"big-{i}", EngineInput(prompt_ids(12, seed=i)), params, group="big")
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    step(), step()
    engine.add_request("other", EngineInput(prompt_ids(12, seed=99)), PARAMS)
    waited = 0
    while engine.requests["other"].status is not RequestStatus.RUNNING:
        step()
        waited += 1
    while engine.has_unfinished():
        step()
    assert_clean(llm)
    return waited, tokens, engine.scheduler.num_preemptions


def test_another_request_is_admitted_while_a_fan_out_runs(tiny_dir):
    fair_wait, fair_tokens, preemptions = _run(tiny_dir, share=0.5)
    fifo_wait, fifo_tokens, _ = _run(tiny_dir, share=1.0)
    assert fair_wait <= 2                     # one step to preempt a sequence over the share, one to admit
    assert fifo_wait >= 2 * PARAMS.max_tokens   # without a share it waits for the fan-out's first two waves
    assert preemptions >= 1
    assert fair_tokens == fifo_tokens         # greedy and seeded: recomputed sequences change no token
    assert all(len(t) == PARAMS.max_tokens for t in fair_tokens.values())


def test_a_lone_fan_out_fills_the_batch(tiny_dir):
    llm = make_llm(tiny_dir, request_share=0.25)
    for i in range(FAN_OUT):
        llm.engine.add_request(f"big-{i}", EngineInput(prompt_ids(12, seed=i)), PARAMS, group="big")
    llm.engine.step()
    assert len(llm.engine.scheduler.running) == 8      # nobody else waits: the share does not idle slots
    assert llm.engine.scheduler.num_preemptions == 0


def _req(group, rid=None):
    return SimpleNamespace(group_key=group, request_id=rid or group)


def test_order_puts_groups_under_their_share_first():
    running = [_req("a"), _req("a")]
    waiting = deque([_req("a", "a3"), _req("a", "a4"), _req("b"), _req("c"), _req("a", "a5")])
    order = [r.request_id for r in fair_order(waiting, running, cap=3)]
    assert order == ["a3", "b", "c", "a4", "a5"]
    assert fair_order(waiting, [], cap=8) is waiting                 # nothing over: the queue as it was


def test_victim_is_the_newest_of_the_group_most_over_its_share():
    running = [_req("a", "a1"), _req("b", "b1"), _req("a", "a2"), _req("a", "a3"), _req("b", "b2")]
    assert fair_victim(deque([_req("c")]), running, cap=2).request_id == "a3"
    assert fair_victim(deque([_req("a", "a9")]), running, cap=2) is None   # only over-share groups wait
    assert fair_victim(deque([_req("c")]), running, cap=3) is None          # nobody over its share


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_share_is_validated(tiny_dir, share):
    with pytest.raises(ValueError, match="request_share"):
        make_llm(tiny_dir, request_share=share)
