"""Verification of a draft block against the target's N+1 logit rows (DSPARK.md 3.5).

Row i of the target logits is the distribution of the token after `[last, d_0..d_{i-1}]`. Each row
first goes through exactly the processing plain sampling applies (penalties and min_tokens with the
output extended by the drafts accepted so far), so greedy speculative output equals plain greedy
output token for token, and any per-position mask added to plain sampling applies here too.

- greedy request: accept d_i iff d_i == argmax; the first mismatch emits the argmax; all accepted
  emits the bonus from row N.
- random request (Leviathan et al.): u ~ U(0,1) from the generator of (seed, position); accept iff
  u * q(d_i) < p(d_i), p the target's sampling distribution, q the draft's (one-hot for a greedy
  draft). On rejection, sample from normalize(max(p - q, 0)); all accepted samples the bonus from p_N.
  The emitted tokens are then distributed exactly as plain sampling from p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engine.sampler import SamplingState, apply_min_tokens, apply_penalties, exponential_race, sampling_probs

_MASK64 = (1 << 63) - 1


def position_seed(base: int, position: int, stream: int) -> int:
    """A seed for (request seed, token position, stream): seeded requests replay whatever the batch."""
    x = (base * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK64


def position_generator(base: int, position: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(position_seed(base, position, stream))


STREAM_DRAFT, STREAM_ACCEPT = 1, 2


@dataclass
class VerifyResult:
    token_ids: list[int]                                    # accepted drafts, then the correction/bonus token
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.token_ids) - 1


def _process_row(row: Tensor, state: SamplingState, emitted: list[int], eos: set[int]) -> Tensor:
    view = SamplingState(state.params, state.prompt_token_ids, state.output_token_ids + emitted, state.generator)
    out = apply_penalties(row[None], [view])
    return apply_min_tokens(out, [view], eos)[0], view


def verify(target_logits: Tensor, drafts: Sequence[int], state: SamplingState, eos_token_ids: set[int],
           first_position: int, seed: int, draft_logits: Tensor | None = None) -> VerifyResult:
    """One request: target_logits [n+1, V] (raw), drafts [n]; first_position = position of row 0's token.

    draft_logits [n, V]: the draft's pre-temperature logits when it sampled (probabilistic draft);
    None means a greedy draft (q one-hot).
    """
    logits = target_logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    plain = state.params.repetition_penalty == 1.0 and state.params.frequency_penalty == 0.0 \
        and state.params.presence_penalty == 0.0 and state.params.min_tokens <= len(state.output_token_ids)
    if state.params.is_greedy and plain:
        chosen = logits.argmax(dim=-1).tolist()
        tokens = []
        for i, t in enumerate(chosen):
            tokens.append(t)
            if i == len(drafts) or drafts[i] != t:
                break
        return _result(raw, tokens, state)
    tokens: list[int] = []
    for i in range(len(drafts) + 1):
        row, view = _process_row(logits[i], state, tokens, eos_token_ids) if not plain else (logits[i], state)
        if state.params.is_greedy:
            t = int(row.argmax())
            tokens.append(t)
            if i == len(drafts) or drafts[i] != t:
                break
            continue
        p = sampling_probs(row[None], [view])[0]
        gen = position_generator(seed, first_position + i + 1, STREAM_ACCEPT)
        if i == len(drafts):
            tokens.append(int(exponential_race(p[None], [gen])[0]))
            break
        d = drafts[i]
        if draft_logits is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = torch.softmax(draft_logits[i].float() / state.params.temperature, dim=-1)
        u = float(torch.rand((), generator=gen))
        if u * float(q[d]) < float(p[d]):
            tokens.append(d)
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:               # p == q up to rounding: any p-sample is exact
            residual = p
        tokens.append(int(exponential_race((residual / residual.sum())[None], [gen])[0]))
        break
    return _result(raw, tokens, state)


def _result(raw: Tensor, tokens: list[int], state: SamplingState) -> VerifyResult:
    rows = torch.arange(len(tokens))
    chosen = raw[rows, torch.tensor(tokens)].tolist()
    n = state.params.logprobs
    if n is None:
        return VerifyResult(tokens, chosen, [None] * len(tokens))
    values, ids = raw[: len(tokens)].topk(min(n, raw.shape[1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return VerifyResult(tokens, chosen, tops)


def sample_draft(logits: Tensor, temperature: float, seed: int, position: int) -> int:
    """A probabilistic draft's token at `position` (Gumbel/exponential race at the request temperature)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(exponential_race(probs[None], [position_generator(seed, position, STREAM_DRAFT)])[0])
