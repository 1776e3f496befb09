"""Constrained requests speculate: verification applies grammar, bad_words, logit_bias and
allowed_token_ids masks position by position, so speculative greedy == plain greedy token for token,
seeded sampling never emits a masked token, and each grammar ends every step at exactly the emitted
tokens."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.token_constraints import bad_words_token_ids
from shared.prompt.tool_grammar import forced_tool_call_grammar
from shared.structured_output import StructuredOutput
from tests.engine.spec_decode.conftest import GREEDY, make_llm, prompt_ids, spec, tokens

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["alpha-beta-gamma", "delta-epsilon", "alpine"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GRAMMARS = {"json": StructuredOutput("json", json.dumps(SCHEMA)), "regex": StructuredOutput("regex", REGEX),
            "choice": StructuredOutput("choice", json.dumps(CHOICES)),
            "tool_required": StructuredOutput("xtml", forced_tool_call_grammar(TOOLS, thinking=False))}
NAMES = [*GRAMMARS, "bad_word_1", "bad_word_2", "logit_bias", "allowed_ids", "free"]
PROMPTS = {name: prompt_ids(6 + 3 * i, 100 + i) for i, name in enumerate(NAMES)}   # 6..30 tokens


def _piece(tokenizer, ids: list[int], length: int) -> str:
    """A word the model emits, `length` tokens long, whose text encodes back to exactly those ids."""
    for i in range(len(ids) - length + 1):
        text = tokenizer.decode(ids[i:i + length])
        if tokenizer.encode(text) == ids[i:i + length] and text.strip() == text:
            return text
    raise AssertionError(f"no {length}-token round-tripping piece in {ids}")


@pytest.fixture(scope="module")
def plain_llm(tiny_dir):
    return make_llm(tiny_dir)


@pytest.fixture(scope="module")
def free(plain_llm):
    """Unconstrained greedy outputs of every prompt."""
    return dict(zip(NAMES, tokens(plain_llm.generate([PROMPTS[n] for n in NAMES], GREEDY)), strict=False))


@pytest.fixture(scope="module")
def cases(plain_llm, free):
    """name -> greedy params (all but `free` constrained, each one built on what unconstrained greedy emits)."""
    tok = plain_llm.tokenizer
    base = SamplingParams(temperature=0.0, max_tokens=40)
    out = {n: replace(base, structured_output=g, skip_special_tokens=n != "tool_required") for n, g in GRAMMARS.items()}
    out["bad_word_1"] = replace(GREEDY, bad_words=[_piece(tok, free["bad_word_1"], 1)])
    out["bad_word_2"] = replace(GREEDY, bad_words=[_piece(tok, free["bad_word_2"][3:], 2)])
    out["logit_bias"] = replace(GREEDY, logit_bias={free["logit_bias"][2]: -100.0, 7: 4.0})
    out["allowed_ids"] = replace(GREEDY, allowed_token_ids=sorted(set(free["allowed_ids"][::3]) | {5, 17, 300}))
    out["free"] = GREEDY
    return out


@pytest.fixture(scope="module")
def plain(plain_llm, free, cases):
    generated = plain_llm.generate([PROMPTS[n] for n in NAMES], [cases[n] for n in NAMES])
    outs = dict(zip(NAMES, tokens(generated), strict=False))
    changed = [n for n in NAMES if n != "free" and outs[n] != free[n]]
    assert changed == NAMES[:-1]                   # every constraint changes the output: the tests can fail
    return outs


@pytest.fixture(scope="module")
def spec_llm(tiny_dir, draft7):
    """One speculating engine for the tests below (each restores the real proposer when done)."""
    return make_llm(tiny_dir, speculative_config=spec(draft7))


@pytest.fixture(scope="module")
def short_spec_llm(tiny_dir, draft7):
    """Draft max_model_len 30: the longest prompts stop speculating, the short ones speculate."""
    return make_llm(tiny_dir, speculative_config=spec(draft7, max_model_len=30))


@pytest.fixture
def fresh(request):
    """Yields a function that takes an engine fixture and returns it with the real proposer and a
    stats snapshot; the oracle a test installs is removed afterwards."""
    used = []

    def get(llm):
        used.append(llm)
        return llm, replace(llm.engine.spec_stats)

    yield get
    for llm in used:
        llm.engine.speculation.__dict__.pop("propose", None)


def _delta(llm, before):
    now = llm.engine.spec_stats
    return (now.num_drafts - before.num_drafts, now.num_draft_tokens - before.num_draft_tokens,
            now.num_accepted_tokens - before.num_accepted_tokens)


def oracle_drafts(llm, references: dict[tuple[int, ...], list[int]], wrong_at) -> None:
    """Draft the known continuation (padded past its end with token 0, so short structured outputs are
    drafted too), corrupted at `wrong_at(step)` (None: exact)."""
    speculation = llm.engine.speculation          # the engine's speculative step (engine/spec_decode/step.py)
    counter = iter(range(10**9))

    def propose(candidates, verify_s=None, step_started=None):
        for req in candidates:
            k = speculation.num_drafts_for(req)
            if k:
                v = req.num_computed_tokens
                drafts = (references[tuple(req.prompt_token_ids)][v + 1: v + 1 + k] + [0] * k)[:k]
                bad = wrong_at(next(counter))
                if bad is not None and bad < k:
                    drafts[bad] = (drafts[bad] + 1) % 1000
                req.spec_token_ids = drafts
        return len(candidates)

    speculation.propose = propose


def _references(plain: dict[str, list[int]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(PROMPTS[n]): PROMPTS[n] + plain[n] for n in NAMES}


def _check_outputs(outs, cases) -> None:
    """What plain decoding guarantees holds under speculation too (grammar outputs validate...)."""
    by_name = dict(zip(NAMES, outs, strict=False))
    jsonschema.validate(json.loads(by_name["json"].output.text), SCHEMA)
    assert re.fullmatch(REGEX, by_name["regex"].output.text)
    assert by_name["choice"].output.text in CHOICES
    for n in ("json", "regex", "choice"):
        assert by_name[n].output.finish_reason == "stop", n
    assert set(by_name["allowed_ids"].output.token_ids) <= set(cases["allowed_ids"].allowed_token_ids)
    assert not {t for t, b in cases["logit_bias"].logit_bias.items() if b < 0} & \
        set(by_name["logit_bias"].output.token_ids)


@pytest.mark.parametrize("mode", ["oracle", "unconstrained_oracle", "random_draft"])
def test_constrained_greedy_speculation_equals_plain(short_spec_llm, fresh, free, cases, plain, mode):
    """One batch: four grammars (json schema, regex, choice, tool_choice required), single- and
    multi-token bad words, logit bias, allowed ids and a free request, speculating and not.
    oracle: the constrained reference, wrong at a moving position (every acceptance depth, grammar
    advanced over many accepted drafts and rolled back); unconstrained_oracle: drafts of what
    unconstrained decoding emits, which the masks must reject; random_draft: the real proposer."""
    llm, before = fresh(short_spec_llm)
    if mode == "oracle":
        oracle_drafts(llm, _references(plain), wrong_at=lambda step: step % 8)
    elif mode == "unconstrained_oracle":
        oracle_drafts(llm, _references(free), wrong_at=lambda step: None)
    outs = llm.generate([PROMPTS[n] for n in NAMES], [cases[n] for n in NAMES])
    assert dict(zip(NAMES, tokens(outs), strict=False)) == plain
    _check_outputs(outs, cases)
    drafts, _, accepted = _delta(llm, before)
    assert drafts > 0
    if mode == "oracle":
        assert accepted > drafts
    llm.engine.check_integrity()


def test_each_constraint_alone_counts_drafts_and_accepted_tokens(spec_llm, fresh, cases, plain):
    """Metrics keep vLLM's meanings for constrained requests: every verified block is a draft, accepted
    drafts are counted (oracle drafts of the constrained reference, every other block wrong at 3)."""
    llm, _ = fresh(spec_llm)
    oracle_drafts(llm, _references(plain), wrong_at=lambda step: 3 if step % 2 else None)
    for name in [*GRAMMARS, "bad_word_1", "bad_word_2", "logit_bias", "allowed_ids"]:
        before = replace(llm.engine.spec_stats)
        assert tokens(llm.generate([PROMPTS[name]], cases[name])) == [plain[name]], name
        drafts, draft_tokens, accepted = _delta(llm, before)
        assert drafts > 0 and draft_tokens >= accepted >= drafts, (name, drafts, draft_tokens, accepted)
    llm.engine.check_integrity()


def _fresh_state_equals(engine, req) -> None:
    """The request's matcher allows exactly what a fresh one allows after its emitted tokens."""
    fresh = engine.grammars.matcher(req.params.structured_output)
    for t in req.output_token_ids:
        fresh.accept(t)
    a, b = req.grammar.bitmask.clone(), fresh.bitmask.clone()
    req.grammar.matcher.fill_next_token_bitmask(a)
    fresh.matcher.fill_next_token_bitmask(b)
    assert torch.equal(a, b) and req.grammar.terminated == fresh.terminated, req.request_id


def test_grammar_is_at_the_emitted_tokens_after_every_step_and_cancel_leaks_nothing(spec_llm, fresh, cases, plain):
    llm, _ = fresh(spec_llm)
    oracle_drafts(llm, _references(plain), wrong_at=lambda step: (2, None, 0, 5)[step % 4])
    engine = llm.engine
    names = [*GRAMMARS, "bad_word_2", "free"]
    for n in names:
        engine.add_request(n, PROMPTS[n], cases[n])
    checked, outs = 0, {}
    for _ in range(4):
        for o in engine.step():
            outs[o.request_id] = o
        for req in engine.requests.values():
            if req.grammar is not None:
                _fresh_state_equals(engine, req)
                checked += 1
    assert checked >= 8
    assert any(r.spec_token_ids for r in engine.requests.values())          # drafts pending: cancel now
    for n in ("json", "tool_required", "bad_word_2"):
        engine.abort(n)
    engine.check_integrity()
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        for req in engine.requests.values():
            if req.grammar is not None:
                _fresh_state_equals(engine, req)
    for n in ("regex", "choice", "free"):
        assert outs[n].output.token_ids == plain[n]
    assert not engine.requests
    assert engine.cache.pool.num_free == engine.cache.pool.usable_blocks
    assert engine.cache.slots.num_free_working == engine.cache_config.num_working_slots


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_seeded_constrained_sampling_never_emits_a_masked_token(tiny_dir, draft7, spec_llm, fresh, cases,
                                                                draft_sample_method):
    """temperature 1: outputs obey every mask, and each seed replays the same tokens in another batch."""
    if draft_sample_method == "greedy":
        llm, before = fresh(spec_llm)
    else:
        llm = make_llm(tiny_dir, speculative_config=spec(draft7, draft_sample_method="probabilistic"))
        before = replace(llm.engine.spec_stats)
    hot = {n: replace(cases[n], temperature=1.0, seed=40 + i) for i, n in enumerate(NAMES)}
    outs = llm.generate([PROMPTS[n] for n in NAMES], [hot[n] for n in NAMES])
    _check_outputs(outs, hot)
    by_name = dict(zip(NAMES, outs, strict=False))
    for n in ("bad_word_1", "bad_word_2"):
        toks = by_name[n].output.token_ids
        for ids in bad_words_token_ids(hot[n].bad_words, llm.tokenizer.encode):
            assert all(toks[i:i + len(ids)] != ids for i in range(len(toks))), (n, ids)
    assert _delta(llm, before)[0] > 0
    order = NAMES[::-1][:6]
    again = llm.generate([PROMPTS[n] for n in order], [hot[n] for n in order])
    assert tokens(again) == [by_name[n].output.token_ids for n in order]
    llm.engine.check_integrity()


def test_constrained_speculation_across_preemption_equals_plain(tiny_dir, draft7):
    """A grammar and allowed ids + bias through preemption mid-speculation (recompute keeps the matcher)."""
    prompts = [prompt_ids(20, 30), prompt_ids(20, 31)]
    params = [SamplingParams(temperature=0.0, max_tokens=14, structured_output=StructuredOutput("regex", "[a-z]{20}")),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, allowed_token_ids=list(range(0, 1024, 7)),
                             logit_bias={7: 2.0, 14: -100.0})]
    no_cache = make_llm(tiny_dir, enable_prefix_caching=False)
    reference = tokens(no_cache.generate(prompts, params))
    budget = dict(enable_prefix_caching=False, max_num_seqs=2, num_snapshot_slots=0,
                  cache_memory_bytes=2 * 8 * 12800 + 15 * (768 + 2 * 4 * 24 * 4))
    tight = make_llm(tiny_dir, speculative_config=spec(draft7), **budget)
    oracle_drafts(tight, {tuple(p): p + r for p, r in zip(prompts, reference, strict=False)},
                  wrong_at=lambda s: (s * 3) % 9)
    outs = tight.generate(prompts, params)
    assert tokens(outs) == reference
    assert re.fullmatch("[a-z]{1,20}", outs[0].output.text)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.spec_stats.num_accepted_tokens > 0
    tight.engine.check_integrity()
