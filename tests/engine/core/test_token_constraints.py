"""allowed_token_ids, bad_words and logit_bias change what is chosen, as vLLM defines them."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampler import SamplingState
from engine.token_constraints import apply_token_constraints, bad_words_token_ids
from tests.engine.core.helpers import bannable_word, make_llm, prompt_ids


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw)


def test_allowed_token_ids_bound_every_choice(llm):
    allowed = [5, 17, 300, 999]
    for params in (_greedy(allowed_token_ids=allowed), SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                                                      ignore_eos=True, allowed_token_ids=allowed)):
        assert set(llm.generate(prompt_ids(6, 1), params)[0].output.token_ids) <= set(allowed)


def test_logit_bias_forces_and_bans(llm):
    prompt = prompt_ids(6, 2)
    free = llm.generate(prompt, _greedy())[0].output.token_ids
    assert llm.generate(prompt, _greedy(logit_bias={42: 100.0}))[0].output.token_ids == [42] * 8
    banned = llm.generate(prompt, _greedy(logit_bias={free[0]: -100.0}))[0].output.token_ids
    assert banned[0] != free[0]


def test_bad_words_never_complete(llm):
    prompt = prompt_ids(6, 3)
    free = llm.generate(prompt, _greedy())[0]
    word = bannable_word(llm.tokenizer, free.output.token_ids)       # a word the model would produce
    out = llm.generate(prompt, _greedy(bad_words=[word]))[0]
    for ids in bad_words_token_ids([word], llm.tokenizer.encode):
        toks = out.output.token_ids
        assert all(toks[i:i + len(ids)] != ids for i in range(len(toks)))
    assert out.output.token_ids != free.output.token_ids


def test_the_hook_a_verifier_calls_sees_the_draft_prefix():
    """A bad word's last token is banned only right after its prefix: the verifier passes the
    draft tokens before each position as output_token_ids."""
    params = SamplingParams(bad_words=["x"])
    row = SamplingState(params, [1], [7, 8], bad_words_token_ids=[[8, 9]])
    masked = apply_token_constraints(torch.zeros(1, 16), [row])
    assert masked[0, 9] == float("-inf") and masked[0].isfinite().sum() == 15
    row.output_token_ids = [7, 8, 3]
    assert apply_token_constraints(torch.zeros(1, 16), [row]).isfinite().all()


@pytest.mark.parametrize("fields, param", [({"logit_bias": {1: 101.0}}, "logit_bias"),
                                           ({"allowed_token_ids": []}, "allowed_token_ids"),
                                           ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
                                           ({"bad_words": [""]}, "bad_words")])
def test_bad_constraints_are_refused(llm, fields, param):
    from shared.errors import InvalidSamplingParams
    with pytest.raises(InvalidSamplingParams) as info:
        llm.generate([1, 2, 3], _greedy(**fields))
    assert info.value.param == param
