"""The shipped tiny-chat checkpoint through `kimi-pd up` (router + P + D), scored with the official openai client.

`kimi-pd up` is started WITHOUT `--model`, so this also checks that tiny-chat is its default. A fixed
sample of held-out instances of every family, thinking on and off, goes through router + P + D: the
answers must equal the offline engine's, tool calls must arrive parsed in `tool_calls`, and the
issue's goal (>= 95 % exact match per family) is asserted.
"""
from __future__ import annotations

import json
import os

import pytest

from engine.training.evaluate import evaluate, format_scores, offline_answerer, router_answerer
from engine.training.tasks import FAMILIES, WEATHER_TOOL, eval_instances
from tests.e2e.fleet import kimi_pd_up

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(420)

SAMPLE_PER_FAMILY = 4
GOAL = 0.95
# Where the shipped checkpoint stands (kimi-pd checkpoint eval, README "tiny-chat"); strict, so the
# marker must go when a retrained checkpoint reaches the goal.
GOAL_GAP = ("shipped tiny-chat (2800 steps, 19 CPU-min per worker) is below 95 % on every family: offline, n=50, "
            "thinking on add 88 %, sub 72 %, multi_turn 74 %, sort 66 %, tool_call 65 % (n=20), reverse 16 %, "
            "tool_answer 6 %; thinking off sort 70 %, tool_call 70 %, reverse 10 %, tool_answer 6 %, "
            "add/sub/multi_turn 0 % "
            "(README 'tiny-chat')")


def _recording(answer_all, into: dict):
    def wrapped(insts, thinking):
        answers = answer_all(insts, thinking)
        for inst, answer in zip(insts, answers, strict=False):
            into[(inst.key, thinking)] = answer
        return answers
    return wrapped


@pytest.fixture(scope="module")
def offline_scores_and_answers():
    import torch

    from engine.presets import shipped_checkpoint
    answers: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the fleet's processes are running on the same 2 cores
    try:
        evaluate(_recording(offline_answerer(str(shipped_checkpoint("tiny-chat"))), answers), FAMILIES,
                 SAMPLE_PER_FAMILY)
    finally:
        torch.set_num_threads(threads)
    return answers


@pytest.fixture(scope="module")
def router_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("tiny-chat-up")
    # One intra-op thread per process: P, D and the router share the 2 cores, and two OpenMP threads
    # per worker spin against each other under load (measured 15x slower decode at load 8).
    with kimi_pd_up([], logs, env={**os.environ, "OMP_NUM_THREADS": "1"}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def routed_scores_and_answers(router_url):
    answers: dict = {}
    scores = evaluate(_recording(router_answerer(router_url, concurrency=16), answers), FAMILIES, SAMPLE_PER_FAMILY)
    return scores, answers


def test_router_pd_answers_equal_offline_llm_answers(routed_scores_and_answers, offline_scores_and_answers):
    """Through router + P + D the greedy answers are exactly the offline engine's, for every family."""
    scores, routed = routed_scores_and_answers
    offline = offline_scores_and_answers
    assert len(scores) == 2 * len(FAMILIES) and all(s.total == SAMPLE_PER_FAMILY for s in scores)
    assert routed.keys() == offline.keys()
    for key, answer in routed.items():
        assert (answer.content, answer.tool_calls) == (offline[key].content, offline[key].tool_calls), key


@pytest.mark.xfail(strict=True, reason=GOAL_GAP)
def test_every_family_reaches_the_goal_through_the_router(routed_scores_and_answers, router_url):
    scores, _ = routed_scores_and_answers
    assert all(s.accuracy >= GOAL for s in scores), format_scores(scores, router_url)


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_is_parsed_into_tool_calls(router_url, thinking):
    """The model's K3 tools channel arrives as an OpenAI tool call (which city it names is the goal test's)."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0, timeout=120)
    inst = eval_instances("tool_call", 1, seed=99)[0]
    messages = [{"role": "user", "content": inst.messages[0]["content"]}]
    first = client.chat.completions.create(model="kimi-k3", messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                           max_tokens=200, extra_body={"chat_template_kwargs": {"thinking": thinking}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert list(json.loads(call.function.arguments)) == ["city"]
