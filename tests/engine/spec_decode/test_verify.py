"""Verification maths: rejection sampling keeps the target's distribution; KDA rollback is exact."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kda import KDAOptions, KimiDeltaAttention
from engine.presets import preset_config
from engine.sampler import SamplingState, sampling_probs
from shared.sampling_params import SamplingParams
from engine.spec_decode.verify import sample_draft, verify

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
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_emitted_tokens_follow_the_target_distribution(draft_kind, params):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, VOCAB, generator=gen) * 1.5           # rows for [last, d0, d1] -> 2 drafts + bonus
    draft = target[:2] + torch.randn(2, VOCAB, generator=gen)     # a related but wrong draft
    state = SamplingState(params, [1, 2, 3], [])
    p = sampling_probs(target, [state] * 3)
    counts = torch.zeros(3, VOCAB)
    for trial in range(TRIALS):
        if draft_kind == "probabilistic":
            drafts = [sample_draft(draft[i], params.temperature, trial, 10 + i) for i in range(2)]
            logits = draft
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
    per-position state slots of one verification extend must equal plain one-token decoding bit for bit."""
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
            assert torch.equal(cache.kda_recurrent[layer_id][got], cache.kda_recurrent[layer_id][1]), k
