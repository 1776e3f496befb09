"""DSpark on a tensor-parallel engine (the draft sharded over the target's ranks, draft TP = target TP):
speculative greedy == plain greedy at TP 1 and 2 for every shipped draft variant, and the sharded
draft drafts what the unsharded one drafts (same acceptance, fp64). TP 2 is two real processes over
gloo on 127.0.0.1, as in tests/engine/parallel."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.presets import shipped_checkpoint
from engine.spec_decode.config import SHIPPED_DRAFTS

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(dtype="float64", max_num_seqs=4, max_num_batched_tokens=512, cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Held-out task prompts of the shipped tiny-chat, one per family (what its drafts were distilled on)."""
    corpus = pytest.importorskip("engine.training.corpus")
    tasks = pytest.importorskip("engine.training.tasks")
    tokenizer = LLM(str(shipped_checkpoint("tiny-chat")), max_num_seqs=1, cache_memory_bytes=1 << 20).tokenizer
    rng, out = random.Random(0), []
    for family in ("add", "reverse", "sort", "tool_call"):
        inst = tasks.eval_instances(family, 1, seed=7)[0]
        ex = corpus.render_example(tokenizer, inst, thinking=rng.random() < 0.5)
        out.append(ex.token_ids[: ex.num_prompt_tokens])
    return out


def generate(prompts, tp: int, draft: str | None = None) -> tuple[list[list[int]], tuple[int, int] | None]:
    spec = None if draft is None else {"method": "dspark", "model": draft, "draft_tensor_parallel_size": tp}
    with LLM(str(shipped_checkpoint("tiny-chat")), tensor_parallel_size=tp, speculative_config=spec,
             **SETTINGS) as llm:
        out = [o.output.token_ids for o in llm.generate(prompts, GREEDY)]
        llm.engine.check_integrity()
        stats = llm.engine.spec_stats
        return out, None if stats is None else (stats.num_drafts, stats.num_accepted_tokens)


@pytest.fixture(scope="module")
def plain(prompts):
    return generate(prompts, 1)[0]


@pytest.mark.parametrize("draft", SHIPPED_DRAFTS)
def test_speculative_greedy_equals_plain_at_tp1_and_tp2(prompts, plain, draft):
    tokens1, stats1 = generate(prompts, 1, draft)
    assert tokens1 == plain
    assert stats1 is not None and stats1[1] > stats1[0], "a trained draft is accepted: > 1 token per step"
    tokens2, stats2 = generate(prompts, 2, draft)
    assert tokens2 == plain
    assert stats2 == stats1, "the draft sharded over 2 ranks drafts what the unsharded one drafts"


def test_pd_between_tp1_and_tp2_carries_the_draft_rows(prompts, plain):
    """A TP 1 prefill's state (with the draft's context rows) imported by a TP 2 decode engine, and a TP 2
    prefill's imported by TP 1: the plain greedy tokens, and the decode side speculates from its first step."""
    from tests.engine.spec_decode.test_pd_spec import pd_generate
    spec = {"method": "dspark", "model": "tiny-chat-dspark"}
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens)
    model = str(shipped_checkpoint("tiny-chat"))
    one = LLM(model, speculative_config=spec, **SETTINGS)
    with LLM(model, tensor_parallel_size=2, speculative_config={**spec, "draft_tensor_parallel_size": 2},
             **SETTINGS) as two:
        for prefill, decode, i in ((one, two, 0), (two, one, 1)):
            before = decode.engine.spec_stats.num_drafts
            state, got = pd_generate(prefill, decode, prompts[i], params)
            assert got == plain[i]
            assert state.draft and all(t.shape[0] == len(prompts[i]) for t in state.draft.values())
            assert decode.engine.spec_stats.num_drafts > before
