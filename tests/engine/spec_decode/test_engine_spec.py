"""Speculative decoding in the engine: greedy == plain token for token, rollback, pages, integrity."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.core.engine import EngineConfig, LLMEngine
from tests.engine.spec_decode.conftest import GREEDY, SETTINGS, make_llm, oracle_drafts, prompt_ids, spec, tokens

PROMPTS = [prompt_ids(9, 1), prompt_ids(23, 2), prompt_ids(4, 3), prompt_ids(15, 4)]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return tokens(make_llm(tiny_dir).generate(PROMPTS, GREEDY))


def references(plain_tokens):
    return {tuple(p): p + out for p, out in zip(PROMPTS, plain_tokens, strict=False)}


@pytest.mark.parametrize("draft_name", ["draft7", "draft5"])
def test_random_draft_greedy_equals_plain(tiny_dir, plain, draft_name, request):
    draft = request.getfixturevalue(draft_name)
    llm = make_llm(tiny_dir, speculative_config=spec(draft))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert llm.engine.spec.num_speculative_tokens == (7 if draft_name == "draft7" else 5)
    llm.engine.check_integrity()


def test_every_acceptance_length_equals_plain(tiny_dir, draft7, plain):
    """Drafts wrong at position 0..7 (7 = all right: bonus token) in turn: every rollback depth."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    oracle_drafts(llm, references(plain), wrong_at=lambda step: step % 8)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > stats.num_drafts            # some blocks accepted whole
    assert stats.accepted_per_pos[6] > 0 and stats.accepted_per_pos[0] < stats.num_drafts
    llm.engine.check_integrity()


def test_perfect_drafts_need_few_target_steps(tiny_dir, draft7, plain):
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    oracle_drafts(llm, references(plain), wrong_at=lambda step: None)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:1]):
        engine.add_request(f"r{i}", p, GREEDY)
    steps = 0
    outs = {}
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["r0"].output.token_ids == plain[0]
    # the prefill step drafts from its first token; then 8 tokens per verification (7 for the last,
    # whose drafts stop at max_tokens): 1 + 8 + 8 + 7 = 24 tokens in 4 target steps
    assert steps == 4, steps
    stats = engine.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 7 + 7 + 6
    assert stats.mean_acceptance_length == pytest.approx(23 / 3)


def test_batch_with_non_speculating_requests(tiny_dir, draft7, plain):
    """Draft max_model_len 30: the 23-token prompt speculates at most a little, the 4-token one all along."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, max_model_len=30))
    oracle_drafts(llm, references(plain), wrong_at=lambda step: step % 5)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert llm.engine.spec_stats.num_drafts > 0
    llm.engine.check_integrity()


def test_mixed_sampling_in_one_batch(tiny_dir, draft7, plain):
    """A greedy request keeps its exact output next to speculating random-sampling requests."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    hot = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=7)
    outs = llm.generate(PROMPTS[:3], [GREEDY, hot, hot])
    assert outs[0].output.token_ids == plain[0]
    assert all(len(o.output.token_ids) == 24 for o in outs)
    again = make_llm(tiny_dir, speculative_config=spec(draft7)).generate([PROMPTS[2], PROMPTS[1]], [hot, hot])
    assert tokens(again) == tokens(outs[1:])[::-1]          # seeded: same tokens whatever the batch
    llm.engine.check_integrity()


def test_preemption_mid_speculation_equals_plain(tiny_dir, draft7):
    prompts = [prompt_ids(20, 30), prompt_ids(20, 31)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    reference = tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, params))
    # 2 requests of 34 tokens + 8-token verify blocks cannot all fit: someone is preempted
    budget = dict(enable_prefix_caching=False, max_num_seqs=2, num_snapshot_slots=0,
                  cache_memory_bytes=2 * 8 * 12800 + 15 * (768 + 2 * 4 * 24 * 4))
    tight = make_llm(tiny_dir, speculative_config=spec(draft7), **budget)
    oracle_drafts(tight, {tuple(p): p + r for p, r in zip(prompts, reference, strict=False)},
                  wrong_at=lambda s: (s * 3) % 9)
    assert tokens(tight.generate(prompts, params)) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.spec_stats.num_drafts > 0
    tight.engine.check_integrity()


def test_prefix_cache_hit_with_speculation_equals_plain(tiny_dir, draft7, plain):
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    first = tokens(llm.generate(PROMPTS[1:2], GREEDY))
    second = llm.generate(PROMPTS[1:2], GREEDY)
    assert second[0].num_cached_tokens > 0
    assert first == tokens(second) == plain[1:2]
    # drafts from a hit read the draft rows the first request wrote: same proposals as a cold engine
    cold = make_llm(tiny_dir, speculative_config=spec(draft7))
    cold.generate(PROMPTS[1:2], GREEDY)
    assert llm.engine.spec_stats.num_accepted_tokens == 2 * cold.engine.spec_stats.num_accepted_tokens
    llm.engine.check_integrity()


def test_rejected_pages_freed_and_kda_close_to_plain(tiny_dir, draft7, plain):
    """After every step the request holds pages for its verified tokens only, and its KDA state is
    that of plain decoding of the same tokens (to fp32 rounding of the batch-shape dependent GEMMs;
    the rollback itself is exact, see test_kda_rollback_is_exact)."""
    spec_llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    oracle_drafts(spec_llm, references(plain), wrong_at=lambda step: (2, 0, 5, 7, 3)[step % 5])
    plain_llm = make_llm(tiny_dir)
    se, pe = spec_llm.engine, plain_llm.engine
    se.add_request("a", PROMPTS[0], GREEDY)
    pe.add_request("a", PROMPTS[0], GREEDY)
    plain_states = {}
    while pe.has_unfinished():
        pe.step()
        req = pe.requests.get("a")
        if req is not None:
            plain_states[req.num_computed_tokens] = kda_state(pe, req.kda_slot)
    compared = 0
    while se.has_unfinished():
        se.step()
        req = se.requests.get("a")
        if req is None:
            break
        assert len(req.blocks) == -(-req.num_computed_tokens // se.config.block_size)
        for got, want in zip(kda_state(se, req.kda_slot), plain_states[req.num_computed_tokens], strict=False):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        compared += 1
    assert compared >= 3
    se.check_integrity()


def kda_state(engine: LLMEngine, slot: int) -> list[torch.Tensor]:
    cache = engine.runner.cache
    return [t[slot].clone() for layer in sorted(cache.kda_conv)
            for t in (cache.kda_conv[layer], cache.kda_recurrent[layer])]


def test_cancel_mid_speculation_leaks_nothing(tiny_dir, draft7):
    engine = make_llm(tiny_dir, speculative_config=spec(draft7)).engine
    for i in range(6):
        engine.add_request(f"r{i}", prompt_ids(10 + i, 50 + i), SamplingParams(temperature=0, max_tokens=40))
    for _ in range(3):
        engine.step()
    assert any(r.spec_token_ids for r in engine.requests.values())      # drafts are pending
    for i in range(0, 6, 2):
        engine.abort(f"r{i}")
    engine.check_integrity()
    engine.step()
    for i in range(1, 6, 2):
        engine.abort(f"r{i}")
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.cache.pool.num_free == engine.cache.pool.usable_blocks
    assert engine.cache.slots.num_free_working == engine.cache_config.num_working_slots


def test_bad_speculative_configs_fail_at_startup(tiny_dir, draft7, tmp_path):
    from engine.spec_decode.config import SpecConfigError
    cases = {
        "unknown": ({"method": "dspark", "model": str(draft7), "num_speculative_token": 7}, "unknown field"),
        "method": ({"method": "eagle3", "model": str(draft7)}, "only 'dspark'"),
        "too many": (spec(draft7, num_speculative_tokens=8), "exceeds the draft's block size"),
        "tp": (spec(draft7, draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
        "sample": (spec(draft7, draft_sample_method="typical"), "draft_sample_method"),
        "no model": ({"method": "dspark"}, "model"),
        "missing dir": (spec(tmp_path / "nowhere"), "no draft config.json"),
        "max len": (spec(draft7, max_model_len=10**6), "max_model_len"),
        "adaptive": (spec(draft7, enable_adaptive_verification=True), "not supported"),
    }
    for cfg, message in cases.values():
        with pytest.raises(SpecConfigError, match=message):
            LLMEngine(EngineConfig(model=str(tiny_dir), speculative_config=cfg, **SETTINGS))
    with pytest.raises(SpecConfigError, match="not valid JSON"):
        LLMEngine(EngineConfig(model=str(tiny_dir), speculative_config="{method", **SETTINGS))


def test_logprobs_and_penalties_under_speculation_equal_plain(tiny_dir, draft7, plain):
    """Verification applies plain sampling's per-position processing: penalties see the accepted drafts,
    reported logprobs are the raw target distribution of each emitted token."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    want = make_llm(tiny_dir).generate(PROMPTS[:2], params)
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    penalised_refs = {tuple(p): p + w.output.token_ids for p, w in zip(PROMPTS[:2], want, strict=False)}
    oracle_drafts(llm, penalised_refs, wrong_at=lambda step: (step * 5) % 8)
    got = llm.generate(PROMPTS[:2], params)
    assert tokens(got) == tokens(want) != plain[:2]
    for g, w in zip(got, want, strict=False):
        torch.testing.assert_close(torch.tensor(g.output.logprobs), torch.tensor(w.output.logprobs), atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in g.output.top_logprobs] == \
               [[t for t, _ in top] for top in w.output.top_logprobs]
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_stop_inside_an_accepted_block_equals_plain(tiny_dir, draft7, plain):
    stop_at = plain[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at], min_tokens=2)
    want = make_llm(tiny_dir).generate(PROMPTS[:1], params)[0].output
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    oracle_drafts(llm, references(plain), wrong_at=lambda step: None)
    got = llm.generate(PROMPTS[:1], params)[0].output
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert len(got.token_ids) <= 6
    llm.engine.check_integrity()


def test_probabilistic_drafts_are_seeded_and_reproducible(tiny_dir, draft7):
    cfg = spec(draft7, draft_sample_method="probabilistic")
    hot = [SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    first = make_llm(tiny_dir, speculative_config=cfg)
    outs = tokens(first.generate(PROMPTS[:3], hot))
    alone = [tokens(make_llm(tiny_dir, speculative_config=cfg).generate([p], [sp]))[0]
             for p, sp in zip(PROMPTS[:3], hot, strict=False)]
    assert outs == alone
    assert first.engine.spec_stats.num_drafts > 0
    first.engine.check_integrity()
