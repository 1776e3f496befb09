"""vLLM's priority scheduling policy: lower `priority` first, then arrival; under memory pressure the
lowest-priority running request is preempted; greedy outputs are the same as under fcfs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.core.helpers import GREEDY, assert_clean, make_llm, prompt_ids, tokens


def finish_order(llm, params_list) -> list[str]:
    ids = [llm.engine.add_request(f"r{i}", prompt_ids(6, i), p) for i, p in enumerate(params_list)]
    order: list[str] = []
    while llm.engine.has_unfinished():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert sorted(order) == sorted(ids)
    return order


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_behind_fifty_low_ones_is_served_first(tiny_dir, policy):
    llm = make_llm(tiny_dir, max_num_seqs=2, scheduling_policy=policy, enable_prefix_caching=False)
    low = replace(GREEDY, max_tokens=1, priority=10)
    order = finish_order(llm, [low] * 50 + [replace(low, priority=0)])
    if policy == "priority":
        assert order[0] == "r50"
    else:                                        # the same run under fcfs: it waits for all 50
        assert order[-1] == "r50"
    assert_clean(llm)


def test_priority_preempts_the_lowest_and_keeps_greedy_outputs(tiny_dir):
    prompts = [prompt_ids(20, 30), prompt_ids(20, 31)]
    reference = tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY))
    # as test_equivalence's preemption case: both 32-token requests cannot finish together
    tight = make_llm(tiny_dir, enable_prefix_caching=False, max_num_seqs=2, num_snapshot_slots=0,
                     cache_memory_bytes=2 * 12800 + 13 * 768, scheduling_policy="priority")
    victims: list[int] = []
    preempt = tight.engine.scheduler._preempt

    def recording(req):
        victims.append(req.priority)
        preempt(req)
    tight.engine.scheduler._preempt = recording
    # the first prompt arrives first but matters less: fcfs would preempt the second (latest admitted)
    params = [replace(GREEDY, priority=5), replace(GREEDY, priority=-1)]
    assert tokens(tight.generate(prompts, params)) == reference
    assert victims and set(victims) == {5}
    assert_clean(tight)


def test_unknown_policy_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_llm(tiny_dir, scheduling_policy="lifo")


def test_a_requests_priority_reaches_the_engine(tiny_dir):
    from shared.openai.convert import to_sampling_params
    from shared.openai.requests import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "priority": -7})
    llm = make_llm(tiny_dir, scheduling_policy="priority")
    rid = llm.engine.add_request("p", prompt_ids(5, 1), to_sampling_params(req))
    assert llm.engine.requests[rid].priority == -7
    llm.engine.abort(rid)
    assert_clean(llm)
