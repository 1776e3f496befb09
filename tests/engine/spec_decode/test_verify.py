"""Verification maths: rejection sampling keeps the target's distribution; KDA rollback is exact."""
from __future__ import annotations

import pytest
import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kda import KDAOptions, KimiDeltaAttention
from engine.presets import preset_config
from engine.sampler import SamplingState, sampling_probs
from engine.spec_decode.verify import sample_draft, verify
from engine.token_constraints import apply_token_constraints
from shared.sampling_params import SamplingParams

# Chi-square critical values at significance 0.001 (df -> value); the test is deterministic (fixed seeds),
# the threshold says how unlikely a correct sampler is to fail it with other seeds.
CHI2_CRIT_0_001 = {3: 16.266, 4: 18.467, 5: 20.515}
VOCAB = 6                       # a tiny vocabulary slice: every cell gets hundreds of samples
TRIALS = 3000


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target cannot sample was emitted"
    n = counts.sum()
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("draft_kind", ["probabilistic", "greedy"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.0, allowed_token_ids=[0, 2, 3, 5]),
                                    SamplingParams(temperature=0.9, logit_bias={1: -100.0, 4: 1.5})],
                         ids=["t1", "topk", "allowed", "bias"])
def test_emitted_tokens_follow_the_target_distribution(draft_kind, params):
    """Also with token masks: p is the MASKED target distribution, the draft proposes unmasked tokens
    (masked ones too), and masked tokens are never emitted (chi2 asserts zero counts off p's support)."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, VOCAB, generator=gen) * 1.5           # rows for [last, d0, d1] -> 2 drafts + bonus
    draft = target[:2] + torch.randn(2, VOCAB, generator=gen)     # a related but wrong draft
    state = SamplingState(params, [1, 2, 3], [])
    p = sampling_probs(apply_token_constraints(target, [state] * 3), [state] * 3)
    masked = bool(params.allowed_token_ids or params.logit_bias)
    counts = torch.zeros(3, VOCAB)
    for trial in range(TRIALS):
        if draft_kind == "probabilistic":
            drafts = [sample_draft(draft[i], params.temperature, trial, 10 + i) for i in range(2)]
            logits = draft
        elif masked:                       # one-hot drafts cycling over every token, masked ones included
            drafts, logits = [trial % VOCAB, (trial // VOCAB) % VOCAB], None
        else:
            drafts, logits = draft.argmax(-1).tolist(), None
        out = verify(target, drafts, state, set(), first_position=9, seed=trial, draft_logits=logits)
        for pos, tok in enumerate(out.token_ids):
            counts[pos, tok] += 1
        assert out.token_ids[:-1] == drafts[:len(out.token_ids) - 1]
    for pos in range(3):
        stat, df = chi2(counts[pos], p[pos])
        assert stat < CHI2_CRIT_0_001[df], (pos, stat, counts[pos].tolist(), p[pos].tolist())
    assert 0 < counts[1].sum() < TRIALS                           # some drafts accepted, some rejected


def test_greedy_accepts_the_argmax_prefix():
    target = torch.tensor([[0.0, 3, 1], [5, 1, 0], [0, 0, 9], [1, 7, 0]])
    state = SamplingState(SamplingParams(temperature=0.0), [0], [])
    assert verify(target, [1, 0, 2], state, set(), 0, 0).token_ids == [1, 0, 2, 1]     # all + bonus
    assert verify(target, [1, 2, 2], state, set(), 0, 0).token_ids == [1, 0]           # corrected at 1
    assert verify(target, [0, 0, 2], state, set(), 0, 0).token_ids == [1]


def test_greedy_verification_applies_penalties_and_min_tokens_per_position():
    """Row i sees the drafts before it as output: a repetition penalty can flip a later argmax."""
    target = torch.tensor([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9], [0.0, 2.0, 1.9]])
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=1.2), [0], [])
    assert verify(target, [1, 1], state, set(), 0, 0).token_ids == [1, 2]
    eos = SamplingState(SamplingParams(temperature=0.0, min_tokens=2), [0], [])
    assert verify(torch.tensor([[9.0, 0, 1], [9.0, 0, 1]]), [2], eos, {0}, 0, 0).token_ids == [2, 2]


def _dyadic(shape, gen, scale):
    return torch.randint(-4, 5, shape, generator=gen).double() / scale


def test_kda_rollback_is_exact():
    """With dyadic fp64 weights and inputs every projection is exact whatever the batch shape, so the
    per-position conv-state slots of one verification extend equal plain one-token decoding bit for bit. The
    recurrent state also goes through the decay (exp) and the delta rule, whose fp64 kernels may group their sums
    differently for a 5-token extend than for one token on some CPUs (seen: 3e-17 on an AMD EPYC): it must agree
    to fp64 rounding (1e-13 of its scale), far below any error a wrong slot or a missed rollback would make."""
    cfg = preset_config("tiny").text_config
    layer_id = cfg.kda_layer_ids[0]
    layer = KimiDeltaAttention(cfg, layer_id, KDAOptions()).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(_dyadic(p.shape, gen, 16) if "conv" in name or "proj" in name else p.double())
            if name == "A_log":
                p.copy_(torch.linspace(-1, 1, p.numel(), dtype=torch.float64))
    cache = HybridCacheTensors.allocate(cfg, 2, 8, 4, torch.float64)
    table = torch.tensor([1])
    x = _dyadic((11, cfg.hidden_size), gen, 4)
    with torch.inference_mode():
        for slot in (0, 1):                                       # same 6-token history in slots 0 and 1
            layer(x[:6], ForwardBatch([SequenceSlice(6, 0, slot, table, reset_kda_state=True)], cache))
        spec_slots = (2, 3, 4, 5)
        layer(x[6:11], ForwardBatch([SequenceSlice(5, 6, 0, table, spec_slots=spec_slots)], cache))
        for k in range(1, 6):
            layer(x[5 + k: 6 + k], ForwardBatch([SequenceSlice(1, 5 + k, 1, table)], cache))
            got = 0 if k == 5 else spec_slots[k - 1]
            assert torch.equal(cache.kda_conv[layer_id][got], cache.kda_conv[layer_id][1]), k
            want = cache.kda_recurrent[layer_id][1]
            torch.testing.assert_close(cache.kda_recurrent[layer_id][got], want, rtol=0,
                                       atol=1e-13 * want.abs().max().item(), msg=f"position {k}")


# ---- token masks at verification ---------------------------------------------------------------------

def _rows(favoured: list[int], masked_favourite: int, vocab: int = 1280) -> torch.Tensor:
    """Rows whose unmasked argmax is `masked_favourite` and whose second best is favoured[i]."""
    rows = torch.zeros(len(favoured), vocab)
    rows[:, masked_favourite] = 10.0
    rows[torch.arange(len(favoured)), torch.tensor(favoured)] = 5.0
    return rows


def test_greedy_masks_allowed_ids_and_logit_bias_on_every_row():
    allowed = SamplingState(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4, 8]), [0], [])
    assert verify(_rows([3, 4, 8, 3], 9), [3, 4, 8], allowed, set(), 0, 0).token_ids == [3, 4, 8, 3]
    assert verify(_rows([3, 4, 8, 3], 9), [9, 4, 8], allowed, set(), 0, 0).token_ids == [3]     # 9 is masked
    biased = SamplingState(SamplingParams(temperature=0.0, logit_bias={9: -100.0}), [0], [])
    assert verify(_rows([3, 4, 8], 9), [3, 9], biased, set(), 0, 0).token_ids == [3, 4]


def test_greedy_bad_words_see_the_drafts_before_each_row():
    """Bad word [4, 9]: 9 is masked exactly at rows that follow an accepted draft 4 (and after output 4)."""
    state = SamplingState(SamplingParams(temperature=0.0, bad_words=["x"]), [0], [7], bad_words_token_ids=[[4, 9]])
    rows = torch.zeros(4, 16)
    rows[[0, 2, 3], 9] = 10.0
    rows[1, 4] = 10.0
    rows[:, 2] = 5.0
    assert verify(rows, [9, 4, 9], state, set(), 0, 0).token_ids == [9, 4, 2]          # 9 banned after 4
    assert verify(rows, [9, 4, 2], state, set(), 0, 0).token_ids == [9, 4, 2, 9]       # 9 allowed after 2
    after_four = SamplingState(state.params, [0], [4], bad_words_token_ids=[[4, 9]])
    assert verify(rows, [9], after_four, set(), 0, 0).token_ids == [2]               # the output's own 4
    single = SamplingState(state.params, [0], [], bad_words_token_ids=[[9]])
    assert verify(rows, [9, 4], single, set(), 0, 0).token_ids == [2]
    unmasked = SamplingState(SamplingParams(temperature=0.0), [0], [7])
    assert verify(rows, [9, 4, 9], unmasked, set(), 0, 0).token_ids == [9, 4, 9, 9]


@pytest.fixture(scope="module")
def grammars(tiny_dir):
    pytest.importorskip("xgrammar")
    from engine.structured_output import GrammarCompiler
    from shared.prompt.tokenizer import KimiTokenizer
    tokenizer = KimiTokenizer.from_dir(tiny_dir)
    return tokenizer, GrammarCompiler(tokenizer, 1280)


def _choice(grammars, *words):
    import json

    from shared.structured_output import StructuredOutput
    return grammars[1].matcher(StructuredOutput("choice", json.dumps(list(words))))


def _same_state(grammar, accepted: list[int], fresh) -> bool:
    """`grammar` allows exactly what a fresh matcher allows after accepting `accepted`."""
    for t in accepted:
        assert fresh.matcher.accept_token(t)
    a, b = grammar.bitmask.clone(), fresh.bitmask.clone()
    grammar.matcher.fill_next_token_bitmask(a)
    fresh.matcher.fill_next_token_bitmask(b)
    return torch.equal(a, b) and grammar.terminated == fresh.terminated


def test_greedy_grammar_mask_follows_the_accepted_drafts(grammars):
    """Row i is masked by the grammar after d_0..d_{i-1}; the matcher is left where it was."""
    tokenizer, _ = grammars
    word = tokenizer.encode("alpha-beta-gamma")
    rows = _rows(word[:5], masked_favourite=5)                       # unmasked, 5 wins every row
    for drafts, want in [(word[:4], word[:5]), ([5] + word[1:4], word[:1]), (word[:2] + [5, word[3]], word[:3])]:
        g = _choice(grammars, "alpha-beta-gamma", "delta-epsilon")
        state = SamplingState(SamplingParams(temperature=0.0), [0], [], grammar=g)
        out = verify(rows, drafts, state, {tokenizer.eos_id}, 0, 0)
        assert out.token_ids == want and out.num_accepted_drafts == len(want) - 1
        assert _same_state(g, [], _choice(grammars, "alpha-beta-gamma", "delta-epsilon"))
    without = verify(rows, word[:4], SamplingState(SamplingParams(temperature=0.0), [0], []), set(), 0, 0)
    assert without.token_ids == [5]                                  # the mask is what made the difference


def test_a_draft_that_terminates_the_grammar_ends_the_block(grammars):
    tokenizer, _ = grammars
    eos = tokenizer.eos_id
    (no,) = tokenizer.encode("no")
    g = _choice(grammars, "no")
    rows = _rows([no, eos, 7, 7], masked_favourite=5)
    out = verify(rows, [no, eos, 7], SamplingState(SamplingParams(temperature=0.0), [0], [], grammar=g), {eos}, 0, 0)
    assert out.token_ids == [no, eos] and out.num_accepted_drafts == 2
    assert out.num_consumed == 2                                     # eos itself is never computed
    assert _same_state(g, [], _choice(grammars, "no"))


@pytest.mark.parametrize("draft_kind", ["probabilistic", "greedy"])
def test_random_grammar_verification_never_emits_a_masked_token(grammars, draft_kind):
    """Seeded sampling: every emitted prefix is one the grammar accepts, and a seed replays exactly."""
    tokenizer, _ = grammars
    words = ("alpha-beta-gamma", "delta-epsilon", "alpine")
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(6, 1280, generator=gen) * 0.5
    draft = torch.randn(5, 1280, generator=gen) * 3
    emitted = {}
    for seed in range(40):
        drafts = ([sample_draft(draft[i], 1.0, seed, 1 + i) for i in range(5)] if draft_kind == "probabilistic"
                  else tokenizer.encode(words[seed % 3])[:5])
        runs = []
        for _ in range(2):
            g = _choice(grammars, *words)
            state = SamplingState(SamplingParams(temperature=1.0, seed=seed), [0], [], grammar=g)
            runs.append(verify(target, drafts, state, {tokenizer.eos_id}, 0, seed,
                               draft if draft_kind == "probabilistic" else None).token_ids)
            fresh = _choice(grammars, *words)
            assert all(fresh.matcher.accept_token(t) for t in runs[-1]), runs[-1]
        assert runs[0] == runs[1]
        emitted[seed] = runs[0]
    assert len({tuple(t) for t in emitted.values()}) > 1
    if draft_kind == "greedy":                                       # valid drafts get accepted
        assert max(len(t) for t in emitted.values()) > 2
