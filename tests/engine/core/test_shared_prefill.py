"""n sequences of one prompt (and identical prompts sent together) compute their shared blocks once:
while one prefills, the others wait, then start from the prefix cache (`waits_for_shared_prefill`)."""
from __future__ import annotations

from engine import SamplingParams
from engine.core.inputs import EngineInput
from engine.core.scheduler import waits_for_shared_prefill
from tests.engine.core.helpers import make_llm, prompt_ids

PROMPT_LEN, BLOCK = 40, 4


def _together(llm, prompt, params, n, salts=None):
    """n requests added before any step (as a fan-out delivers them): their outputs in order."""
    ids = [f"seq-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        sp = params.for_sequence(i)
        if salts is not None:
            from dataclasses import replace
            sp = replace(sp, cache_salt=salts[i])
        llm.engine.add_request(rid, EngineInput(list(prompt)), sp)
    return llm._run(ids)


def test_n_sequences_prefill_the_prompt_once(tiny_dir):
    llm = make_llm(tiny_dir)
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    params = SamplingParams(temperature=0.9, seed=5, n=4, max_tokens=5, ignore_eos=True)
    outs = _together(llm, prompt, params, 4)
    # the first computes all 40; each other one computes only the last, partial-or-final block
    assert [o.num_cached_tokens for o in outs] == [0] + [PROMPT_LEN - BLOCK] * 3
    alone = [make_llm(tiny_dir).generate(prompt, params.for_sequence(i))[0].output.token_ids for i in range(4)]
    assert [o.output.token_ids for o in outs] == alone               # sharing changes no token
    assert len({tuple(t) for t in alone}) > 1
    via_n = llm.generate(prompt, params)[0]                          # LLM(n=4): the same four sequences
    assert [o.token_ids for o in via_n.outputs] == alone


def test_different_salts_do_not_wait_for_each_other(tiny_dir):
    llm = make_llm(tiny_dir)
    outs = _together(llm, prompt_ids(PROMPT_LEN, seed=4), SamplingParams(temperature=0, max_tokens=2), 3,
                     salts=["a", "b", "c"])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]


def test_without_prefix_caching_nobody_waits(tiny_dir):
    llm = make_llm(tiny_dir, enable_prefix_caching=False)
    outs = _together(llm, prompt_ids(PROMPT_LEN, seed=5), SamplingParams(temperature=0, max_tokens=2), 3)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert len({tuple(o.output.token_ids) for o in outs}) == 1


def test_wait_rule():
    from types import SimpleNamespace as R

    def req(hashes, computed=0, prompt=40, imported=None, logprobs=False):
        return R(block_hashes=hashes, num_computed_tokens=computed, num_prompt_tokens=prompt, imported=imported,
                 wants_prompt_logprobs=logprobs)
    prefilling, done = req([1, 2], computed=8), req([1, 2], computed=40)
    assert waits_for_shared_prefill(req([1, 9]), [prefilling])
    assert not waits_for_shared_prefill(req([1, 9]), [done])                 # committed: it will hit
    assert not waits_for_shared_prefill(req([7]), [prefilling])              # another prompt
    assert not waits_for_shared_prefill(req([]), [prefilling])               # under one block: nothing to share
    assert not waits_for_shared_prefill(req([1], logprobs=True), [prefilling])   # scores never hit the cache
    assert not waits_for_shared_prefill(req([1], imported=object()), [prefilling])
