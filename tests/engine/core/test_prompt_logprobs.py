"""Prompt logprobs (vLLM's `prompt_logprobs`, what lm-eval's loglikelihood needs): equal to the
logprobs the same tokens get when generated, the same chunked or whole, alone or batched, with the
prefix cache warm, after export/import, and with max_tokens=0."""
from __future__ import annotations

import math

import pytest

from engine import SamplingParams
from tests.engine.core.helpers import make_llm, prompt_ids

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def _scores(out):
    return [None if e is None else (e.token_id, e.logprob, e.rank, e.top) for e in out.prompt_logprobs]


def test_scores_equal_the_logprobs_of_generated_tokens(llm):
    prompt = prompt_ids(9, seed=1)
    gen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    scored = llm.generate(prompt + gen.output.token_ids,
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    pl = scored.prompt_logprobs
    assert len(pl) == 15 and pl[0] is None
    assert [e.token_id for e in pl[1:]] == (prompt + gen.output.token_ids)[1:]
    for entry, logprob in zip(pl[9:], gen.output.logprobs, strict=False):
        assert entry.rank == 1                               # greedy tokens are the most likely
        assert math.isclose(entry.logprob, logprob, abs_tol=TOL)
        assert entry.top[0][0] == entry.token_id and len(entry.top) == 3
    assert gen.prompt_logprobs is None                       # not asked for: not computed


def test_chunked_batched_and_cache_hit_equal_whole(tiny_dir, llm):
    prompt = prompt_ids(40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    whole = _scores(llm.generate(prompt, params)[0])
    chunked = make_llm(tiny_dir, max_num_batched_tokens=7)
    assert _close(_scores(chunked.generate(prompt, params)[0]), whole)
    others = [prompt_ids(13, seed=3), prompt[:20]]
    batched = chunked.generate([others[0], prompt, others[1]], params)
    assert _close(_scores(batched[1]), whole)
    warm = chunked.generate(prompt, params)[0]               # its prefix is cached now: not used for scoring
    assert warm.num_cached_tokens == 0 and _close(_scores(warm), whole)


def test_max_tokens_zero_scores_the_prompt_only(llm):
    prompt = prompt_ids(11, seed=4)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))[0]
    assert out.output.token_ids == [] and out.output.finish_reason == "length"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert _close(_scores(out), _scores(ref))
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    llm.engine.check_integrity()


def test_prompt_logprobs_travel_with_an_exported_state(tiny_dir, llm):
    prompt = prompt_ids(17, seed=5)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    local = llm.generate(prompt, params)[0]
    prefill, decode = make_llm(tiny_dir), make_llm(tiny_dir)
    rid = prefill.engine.add_request("p", prompt, params, export_state=True)
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    state = prefill.engine.export_state(rid)
    meta, tensors = state.to_parts()
    from engine.core.state_export import ExportedState
    decode.engine.add_request("d", prompt, params, imported=ExportedState.from_parts(meta, tensors))
    final = None
    while decode.engine.has_unfinished():
        for out in decode.engine.step():
            final = out if out.finished else final
    assert final.output.token_ids == local.output.token_ids
    assert _close(_scores(final), _scores(local))
    prefill.engine.release_export(rid)


def _close(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=False):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if x[0] != y[0] or x[2] != y[2] or not math.isclose(x[1], y[1], abs_tol=TOL):
            return False
        if [i for i, _ in x[3]] != [i for i, _ in y[3]]:
            return False
    return True
