from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    SamplingState,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample,
)
from shared.sampling_params import SamplingParams

EOS = 7
V = 32


def state(prompt=(), output=(), **kwargs) -> SamplingState:
    params = SamplingParams(**kwargs)
    return SamplingState(params, list(prompt), list(output), make_generator(params.seed))


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def with_clear_winner(logits: torch.Tensor, margin: float) -> torch.Tensor:
    """Raise each row's max so it leads the runner-up by exactly `margin`."""
    logits = logits.clone()
    top2 = logits.topk(2, dim=-1)
    logits.scatter_(1, top2.indices[:, :1], top2.values[:, 1:] + margin)
    return logits


# ---- greedy and its limits ------------------------------------------------------------------------

def test_greedy_is_exact_argmax_and_leaves_logits_alone():
    logits = random_logits(6)
    before = logits.clone()
    out = sample(logits, [state(temperature=0.0) for _ in range(6)], {EOS})
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-3},                  # temperature -> 0
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.5, "top_p": 1e-6},
    {"temperature": 1.0, "min_p": 1.0},
], ids=["t->0", "top_k=1", "top_p tiny", "min_p=1"])
def test_limits_equal_greedy(kwargs):
    logits = with_clear_winner(random_logits(8, seed=1), margin=0.1)
    rows = [state(seed=s, **kwargs) for s in range(8)]
    for _ in range(5):
        assert sample(logits, rows, {EOS}).token_ids == logits.argmax(-1).tolist()


def test_tiny_temperature_does_not_overflow():
    logits = torch.tensor([[1e30, 0.0, -1e30]])
    assert sample(logits, [state(temperature=1e-5, seed=0)], {EOS}).token_ids == [0]


# ---- truncation functions -------------------------------------------------------------------------

PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4]])


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


@pytest.mark.parametrize(("k", "expected"), [(1, [3]), (2, [2, 3]), (4, [0, 1, 2, 3]), (99, [0, 1, 2, 3])])
def test_top_k_keeps_k_largest(k, expected):
    assert kept(apply_top_k(PROBS.log(), torch.tensor([k]))) == expected


@pytest.mark.parametrize(("p", "expected"), [(0.35, [3]), (0.4, [3]), (0.65, [2, 3]), (0.95, [0, 1, 2, 3]),
                                             (1.0, [0, 1, 2, 3]), (1e-9, [3])])
def test_top_p_keeps_smallest_set_reaching_p(p, expected):
    assert kept(apply_top_p(PROBS.log(), torch.tensor([p]))) == expected


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2, 3]), (0.45, [1, 2, 3]),
                                                 (0.6, [2, 3]), (0.76, [3]), (1.0, [3])])
def test_min_p_is_relative_to_top_probability(min_p, expected):
    assert kept(apply_min_p(PROBS.log(), torch.tensor([min_p]))) == expected


def test_min_p_sampling_never_draws_below_threshold():
    row = state(seed=3, min_p=0.45)                     # keeps p >= 0.18: tokens 1, 2, 3
    drawn = {sample(PROBS.log(), [row], {EOS}).token_ids[0] for _ in range(300)}
    assert drawn == {1, 2, 3}


# ---- penalties ------------------------------------------------------------------------------------

BASE = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])


@pytest.mark.parametrize(("kwargs", "prompt", "output", "expected"), [
    # repetition: prompt and output tokens; positive / penalty, negative * penalty
    ({"repetition_penalty": 2.0}, [0], [1, 1], [1.0, -2.0, 0.5, 3.0, 1.0]),
    ({"repetition_penalty": 0.5}, [3], [2], [2.0, -1.0, 1.0, 6.0, 1.0]),
    # frequency: output tokens only, per occurrence
    ({"frequency_penalty": 0.5}, [0, 3], [2, 2, 1], [2.0, -1.5, -0.5, 3.0, 1.0]),
    # presence: output tokens only, once
    ({"presence_penalty": 0.5}, [0, 3], [2, 2, 1], [2.0, -1.5, 0.0, 3.0, 1.0]),
    ({"presence_penalty": -1.0}, [], [4, 4, 4], [2.0, -1.0, 0.5, 3.0, 2.0]),
    # all three: repetition first, then frequency and presence
    ({"repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.25}, [0], [2, 2],
     [1.0, -1.0, 0.25 - 2.0 - 0.25, 3.0, 1.0]),
])
def test_penalty_changes_exactly_what_it_should(kwargs, prompt, output, expected):
    neutral = state(prompt=[0, 1, 2, 3, 4], output=[0, 1, 2, 3, 4])
    logits = torch.cat([BASE, BASE])
    got = apply_penalties(logits, [state(prompt, output, **kwargs), neutral])
    assert got[0].tolist() == pytest.approx(expected)
    assert torch.equal(got[1], BASE[0])                 # a row without penalties is untouched


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0]])
    assert sample(logits, [state(prompt=[0], temperature=0)], {EOS}).token_ids == [0]
    assert sample(logits, [state(prompt=[0], temperature=0, repetition_penalty=2.0)], {EOS}).token_ids == [1]


# ---- min_tokens -----------------------------------------------------------------------------------

def eos_favoured() -> torch.Tensor:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    return logits


@pytest.mark.parametrize(("kwargs", "outputs", "expected"), [
    ({"min_tokens": 3}, 2, 5),                          # eos masked until 3 tokens exist
    ({"min_tokens": 3}, 3, EOS),
    ({"min_tokens": 3, "ignore_eos": True}, 0, EOS),    # eos does not stop, so it is not masked
    ({"min_tokens": 3, "stop_token_ids": [5]}, 0, 0),   # stop ids are masked too (then 0 wins the tie)
    ({}, 0, EOS),
])
def test_min_tokens_masks_stopping_tokens(kwargs, outputs, expected):
    row = state(output=[1] * outputs, temperature=0, **kwargs)
    assert sample(eos_favoured(), [row], {EOS}).token_ids == [expected]


def test_min_tokens_masks_eos_when_sampling():
    rows = [state(seed=s, min_tokens=1) for s in range(200)]
    assert EOS not in sample(eos_favoured().expand(200, V), rows, {EOS}).token_ids


# ---- seeds ----------------------------------------------------------------------------------------

def run_steps(logits: torch.Tensor, rows: list[SamplingState], steps: int) -> list[list[int]]:
    """Sample `steps` times, appending each row's token to its output; returns each row's tokens."""
    for _ in range(steps):
        for row, token in zip(rows, sample(logits, rows, {EOS}).token_ids, strict=False):
            row.output_token_ids.append(token)
    return [row.output_token_ids for row in rows]


def test_seeded_rows_independent_of_batch_composition_and_order():
    logits = random_logits(1, seed=5) / 3
    alone = run_steps(logits, [state(seed=42)], 20)[0]
    others = [state(seed=7, top_k=5), state(temperature=0), state(seed=None, top_p=0.5), state(seed=1)]
    batch = others[:2] + [state(seed=42)] + others[2:]
    together = run_steps(logits.expand(5, V), batch, 20)[2]
    assert together == alone
    reordered = [state(seed=42)] + [state(seed=9) for _ in range(3)]
    assert run_steps(logits.expand(4, V), reordered, 20)[0] == alone


def test_different_seeds_differ_and_unseeded_follow_global_rng():
    logits = torch.zeros(1, 1000)
    runs = {seed: run_steps(logits, [state(seed=seed)], 10)[0] for seed in (1, 2, 3)}
    assert len({tuple(r) for r in runs.values()}) == 3
    torch.manual_seed(0)
    first = run_steps(logits, [state()], 10)[0]
    torch.manual_seed(0)
    assert run_steps(logits, [state()], 10)[0] == first


# ---- distribution ---------------------------------------------------------------------------------

CHI2_3DOF_P999 = 16.27        # chi-square 99.9% quantile, 3 degrees of freedom


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, [0.1, 0.2, 0.3, 0.4]),
    ({"temperature": 0.5}, [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3]),
    ({"top_p": 0.65}, [0.0, 0.0, 3 / 7, 4 / 7]),
    ({"top_k": 3}, [0.0, 2 / 9, 3 / 9, 4 / 9]),
])
def test_sampling_matches_distribution(kwargs, expected):
    draws = 4000
    rows = [state(seed=1234, **kwargs)]
    counts = [0] * 4
    for _ in range(draws):
        counts[sample(PROBS.log(), rows, {EOS}).token_ids[0]] += 1
    chi2 = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, expected, strict=False) if p > 0)
    assert chi2 < CHI2_3DOF_P999, (counts, expected)
    assert all(c == 0 for c, p in zip(counts, expected, strict=False) if p == 0)


# ---- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_whatever_the_processing():
    logits = random_logits(4, seed=2)
    rows = [state(temperature=0.3, top_k=3, seed=0, prompt=[1, 2], repetition_penalty=1.5),
            state(temperature=0, presence_penalty=1.0, output=[int(logits[1].argmax())]),
            state(min_p=0.2, seed=1),
            state(seed=2, min_tokens=2)]
    out = sample(logits, rows, {EOS})
    raw = torch.log_softmax(logits, dim=-1)
    expected = [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-6)


def test_top_logprobs_sorted_and_per_row_n():
    logits = random_logits(3, seed=3)
    rows = [state(logprobs=3, seed=0), state(seed=1), state(logprobs=0, temperature=0)]
    out = sample(logits, rows, {EOS})
    raw = torch.log_softmax(logits, dim=-1)
    order = raw[0].argsort(descending=True)[:3].tolist()
    assert [t for t, _ in out.top_logprobs[0]] == order
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(raw[0, order].tolist())
    assert all(a[1] >= b[1] for a, b in zip(out.top_logprobs[0], out.top_logprobs[0][1:], strict=False))
    assert out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []


def test_logprob_of_certain_token_is_zero():
    logits = torch.tensor([[0.0, 100.0, 0.0]])
    out = sample(logits, [state(temperature=0, logprobs=1)], {EOS})
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-6)
    assert out.top_logprobs[0][0][0] == 1 and math.isclose(out.top_logprobs[0][0][1], out.logprobs[0])


def test_batch_shape_is_checked():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, V), [state()], {EOS})
