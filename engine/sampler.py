"""Token sampling for a batch of requests with different `SamplingParams`.

`sample` runs, row by row in effect but batched in tensors:

    raw logits ──► log_softmax ─────────────────────────────────► reported logprobs / top-n
        │
        ├─► penalties (repetition: prompt+output; presence/frequency: output)
        ├─► min_tokens: stop ids (eos unless ignore_eos, stop_token_ids) at -inf
        ├─► token constraints: allowed_token_ids, bad_words, logit_bias (engine.token_constraints)
        ├─► greedy rows: argmax, done
        └─► random rows: temperature ► top-k ► top-p ► min-p ► exponential race with the row's generator

Every step after the raw logprobs is a pure function of (logits, per-row parameter tensors).
Random rows draw their noise only from their own request's generator, so a seeded request gets the
same tokens whatever else is in the batch, and in whatever order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.token_constraints import apply_token_constraints
from shared.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingState:
    """What the sampler needs of one request; `output_token_ids` is the request's own, growing list."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None    # None: torch's default generator
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    grammar: Any = None                         # engine.structured_output.RequestGrammar, if constrained

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: list[int],
               device: torch.device | str = "cpu") -> SamplingState:
        """A state with an empty output and the request's own generator, seeded once here."""
        return cls(params, prompt_token_ids, [], make_generator(params.seed, device))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                                   # of the sampled token, raw distribution
    top_logprobs: list[list[tuple[int, float]] | None]      # top-n raw (id, logprob), best first


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator: from its seed, else from torch's global RNG (so `torch.manual_seed` replays runs)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def sample(logits: Tensor, requests: Sequence[SamplingState], eos_token_ids: Iterable[int]) -> SamplerOutput:
    """One token per row of `logits` [B, V] (upcast to fp32; not modified). Advances random rows' generators."""
    _check_batch(logits, requests)
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    processed = apply_penalties(logits, requests)
    processed = apply_min_tokens(processed, requests, set(eos_token_ids))
    processed = apply_token_constraints(processed, requests)
    token_ids = _choose(processed, requests)
    return _output(raw_logprobs, token_ids, requests)


def _check_batch(logits: Tensor, requests: Sequence[SamplingState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(
            f"logits must be [{len(requests)}, vocab] for {len(requests)} requests, got {list(logits.shape)}")


# ---- penalties and masks (all rows) -------------------------------------------------------------

def apply_penalties(logits: Tensor, requests: Sequence[SamplingState]) -> Tensor:
    """Repetition penalty over prompt+output tokens, then frequency and presence over output tokens."""
    params = [r.params for r in requests]
    if any(p.repetition_penalty != 1.0 for p in params):
        # rows without the penalty contribute no ids, so their (penalty 1.0) rows are untouched anyway
        seen = [r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0 else []
                for r in requests]
        penalty = _row_values([p.repetition_penalty for p in params], logits)
        logits = apply_repetition_penalty(logits, token_counts(seen, logits.shape[1], logits.device) > 0, penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = token_counts([r.output_token_ids for r in requests], logits.shape[1], logits.device)
        frequency = _row_values([p.frequency_penalty for p in params], logits)
        presence = _row_values([p.presence_penalty for p in params], logits)
        logits = apply_frequency_presence_penalties(logits, counts, frequency, presence)
    return logits


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, V] float counts of each id per row; rows are padded with an extra, dropped column V."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor([list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids],
                          dtype=torch.long, device=device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL/HF rule on `seen` [B, V] ids: positive logits divided by the penalty, negative multiplied."""
    penalty = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(logits: Tensor, counts: Tensor, frequency: Tensor, presence: Tensor) -> Tensor:
    """OpenAI rule: logit -= frequency * count + presence * (count > 0)."""
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_tokens(logits: Tensor, requests: Sequence[SamplingState], eos_token_ids: set[int]) -> Tensor:
    """Rows that have fewer than `min_tokens` outputs cannot pick a token that would stop them."""
    rows: list[int] = []
    cols: list[int] = []
    for row, r in enumerate(requests):
        if len(r.output_token_ids) < r.params.min_tokens:
            ids = sorted(r.params.all_stop_token_ids(eos_token_ids))
            rows += [row] * len(ids)
            cols += ids
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(_NEG_INF, device=logits.device))


# ---- choosing the token ------------------------------------------------------------------------

def _choose(logits: Tensor, requests: Sequence[SamplingState]) -> Tensor:
    """Greedy rows take the argmax exactly; random rows are sampled and written over it."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if not random_rows:
        return token_ids
    index = torch.tensor(random_rows, device=logits.device)
    sampled = _sample_random(logits.index_select(0, index), [requests[i] for i in random_rows])
    return token_ids.index_copy(0, index, sampled)


def _sample_random(logits: Tensor, requests: Sequence[SamplingState]) -> Tensor:
    return exponential_race(sampling_probs(logits, requests), [r.generator for r in requests])


def sampling_probs(logits: Tensor, requests: Sequence[SamplingState]) -> Tensor:
    """The distribution random rows sample from: temperature, top-k, top-p, min-p, softmax (rejection
    sampling in speculative decoding needs it explicitly, as the target's p)."""
    params = [r.params for r in requests]
    vocab = logits.shape[1]
    logits = apply_temperature(logits, _row_values([p.temperature for p in params], logits))
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_k):
        logits = apply_top_k(logits, torch.tensor(top_k, device=logits.device))
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, _row_values([p.top_p for p in params], logits))
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, _row_values([p.min_p for p in params], logits))
    return logits.softmax(dim=-1)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide by T after subtracting the row max, so a tiny T cannot overflow (same softmax)."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted / temperature.unsqueeze(1)


def apply_top_k(logits: Tensor, k: Tensor) -> Tensor:
    """Keep logits >= the k-th largest of their row (ties at the threshold survive)."""
    k = k.clamp(1, logits.shape[1])
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the fewest most-likely tokens whose probability sums to at least `top_p`.

    Sorted ascending, a token is dropped when its cumulative mass (itself included) is at most 1-p;
    the most likely token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, _NEG_INF))


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, _NEG_INF)


def exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """argmax(p / E) with E ~ Exp(1) picks i with probability p_i; each row's E comes from its generator."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators, strict=False):
        row.exponential_(generator=generator)
    return probs.div(noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


# ---- output ------------------------------------------------------------------------------------

def _output(raw_logprobs: Tensor, token_ids: Tensor, requests: Sequence[SamplingState]) -> SamplerOutput:
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return SamplerOutput(token_ids.tolist(), chosen.tolist(), _top_logprobs(raw_logprobs, requests))


def _top_logprobs(raw_logprobs: Tensor, requests: Sequence[SamplingState]) -> list[list[tuple[int, float]] | None]:
    """One topk for the largest n in the batch, cut per row; None where logprobs were not asked for."""
    wanted = [r.params.logprobs for r in requests]
    n_max = min(max((n or 0 for n in wanted), default=0), raw_logprobs.shape[1])
    values, ids = raw_logprobs.topk(n_max, dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [None if n is None else list(zip(ids_l[i][:n], values_l[i][:n], strict=False)) for i, n in enumerate(wanted)]


def _row_values(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)
