"""P/D with speculation: the prefill's exported state carries the draft's prompt context rows, so the
decode engine drafts exactly as a colocated one would; without them it decodes unspeculated."""
from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from engine.spec_decode.proposer import DSparkProposer
from tests.engine.spec_decode.conftest import GREEDY, make_llm, prompt_ids, spec

PROMPT = prompt_ids(13, 77)


def record_proposals(llm) -> dict[int, list[int]]:
    """num_verified -> drafted tokens, for every proposal the engine makes."""
    seen: dict[int, list[int]] = {}
    proposer: DSparkProposer = llm.engine.proposer
    original = proposer.propose

    def propose(reqs):
        blocks = original(reqs)
        for r, b in zip(reqs, blocks, strict=False):
            seen[r.num_verified] = b.token_ids
        return blocks

    proposer.propose = propose
    return seen


def pd_generate(prefill, decode, prompt, params):
    pe, de = prefill.engine, decode.engine
    pe.add_request("p", prompt, params, export_state=True)
    while pe.has_unfinished():
        pe.step()
    state = pe.export_state("p")
    pe.release_export("p")
    de.add_request("d", prompt, params, imported=state)
    final = None
    while de.has_unfinished():
        for out in de.step():
            if out.finished:
                final = out
    pe.check_integrity()
    de.check_integrity()
    return state, final.output.token_ids


def test_pd_decode_drafts_like_colocated(tiny_dir, draft7):
    colocated = make_llm(tiny_dir, speculative_config=spec(draft7))
    seen_colocated = record_proposals(colocated)
    expected = colocated.generate([PROMPT], GREEDY)[0].output.token_ids
    prefill = make_llm(tiny_dir, speculative_config=spec(draft7))
    decode = make_llm(tiny_dir, speculative_config=spec(draft7))
    seen_pd = record_proposals(decode)
    state, got = pd_generate(prefill, decode, PROMPT, GREEDY)
    assert got == expected
    assert set(state.draft) == set(range(decode.engine.proposer.cfg.num_hidden_layers))
    assert all(t.shape[0] == len(PROMPT) for t in state.draft.values())
    common = set(seen_pd) & set(seen_colocated)
    assert len(common) >= 3
    assert all(seen_pd[v] == seen_colocated[v] for v in common)
    assert decode.engine.spec_stats.num_drafts > 0


def test_pd_without_draft_rows_decodes_unspeculated(tiny_dir, draft7, draft5):
    plain = make_llm(tiny_dir).generate([PROMPT], GREEDY)[0].output.token_ids
    for prefill in (make_llm(tiny_dir), make_llm(tiny_dir, speculative_config=spec(draft5))):
        decode = make_llm(tiny_dir, speculative_config=spec(draft7))      # other (or no) draft on the prefill
        _, got = pd_generate(prefill, decode, PROMPT, GREEDY)
        assert got == plain
        assert decode.engine.spec_stats.num_drafts == 0


def test_pd_constrained_requests_speculate_like_colocated(tiny_dir, draft7):
    """A grammar and a bad word through P/D: the prefill masks the first token, the decode worker's
    matcher adopts it and verification masks every draft position; == plain colocated greedy."""
    pytest.importorskip("xgrammar")
    from dataclasses import replace

    from shared.structured_output import StructuredOutput
    from tests.engine.core.helpers import bannable_word
    schema = StructuredOutput("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                 "required": ["n"], "additionalProperties": False}))
    plain_llm = make_llm(tiny_dir)
    free = plain_llm.generate([PROMPT], GREEDY)[0].output.token_ids
    cases = [SamplingParams(temperature=0.0, max_tokens=40, structured_output=schema),
             replace(GREEDY, bad_words=[bannable_word(plain_llm.tokenizer, free[3:])]),
             replace(GREEDY, allowed_token_ids=sorted(set(free[::2]) | {3, 5}), logit_bias={free[1]: -100.0})]
    prefill = make_llm(tiny_dir, speculative_config=spec(draft7))
    decode = make_llm(tiny_dir, speculative_config=spec(draft7))
    for params in cases:
        want = plain_llm.generate([PROMPT], params)[0].output.token_ids
        assert want != free
        drafts_before = decode.engine.spec_stats.num_drafts
        _, got = pd_generate(prefill, decode, PROMPT, params)
        assert got == want
        assert decode.engine.spec_stats.num_drafts > drafts_before          # it speculated
        if params.structured_output is not None:                            # still valid for its schema
            text = plain_llm.tokenizer.decode([t for t in got if t != plain_llm.tokenizer.eos_id])
            assert isinstance(json.loads(text)["n"], int), text
