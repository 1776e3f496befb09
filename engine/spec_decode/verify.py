"""Verification of a draft block against the target's N+1 logit rows (docs/dspark.md 3.5).

Row i of the target logits is the distribution of the token after `[last, d_0..d_{i-1}]`. Each row
first goes through exactly the processing plain sampling applies, with the output extended by the
drafts accepted so far: penalties, min_tokens, then the request's token masks (allowed_token_ids,
logit_bias, bad_words, whose prefixes may end in drafts, and the structured-output grammar in the
state after d_0..d_{i-1}). So greedy speculative output equals plain greedy output token for token,
and no emitted token is one plain sampling could not choose.

- greedy request: accept d_i iff d_i == argmax; the first mismatch emits the argmax; all accepted
  emits the bonus from row N.
- random request (Leviathan et al.): u ~ U(0,1) from the generator of (seed, position); accept iff
  u * q(d_i) < p(d_i), p the target's masked sampling distribution, q the draft's (one-hot for a
  greedy draft). On rejection, sample from normalize(max(p - q, 0)); all accepted samples the bonus
  from p_N. The emitted tokens are then distributed exactly as plain sampling from p, for ANY q: the
  draft's proposals are not masked (a masked-out draft has p = 0, so it is always rejected, and the
  residual is 0 wherever p is), which costs acceptance on constrained requests, never correctness.

A grammar is advanced tentatively over the accepted drafts (to mask the next row) and rolled back
before returning: `verify` leaves the matcher where it found it, and the engine accepts the emitted
tokens as it appends them, as for any sampled token. A draft that terminates the grammar ends the
block there, without a bonus token (plain decoding stops on that token too).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampler import SamplingState, apply_min_tokens, apply_penalties, exponential_race, sampling_probs
from engine.token_constraints import apply_token_constraints, has_constraints

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
    token_ids: list[int]                 # accepted drafts, then the correction/bonus token (if any)
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_accepted_drafts: int

    @property
    def num_consumed(self) -> int:
        """Verified positions whose KV/state stays: `last` and every emitted token but the final one."""
        return len(self.token_ids)


def _row_state(state: SamplingState, emitted: list[int]) -> SamplingState:
    """The request as plain sampling would see it after emitting `emitted` (same grammar object)."""
    return SamplingState(state.params, state.prompt_token_ids, state.output_token_ids + emitted, state.generator,
                         state.bad_words_token_ids, state.grammar)


def _process_row(row: Tensor, view: SamplingState, eos: set[int]) -> Tensor:
    """Plain sampling's processing of one row: penalties, min_tokens, token masks (the grammar's too)."""
    out = apply_min_tokens(apply_penalties(row[None], [view]), [view], eos)
    return apply_token_constraints(out, [view])[0]


def _position_free(state: SamplingState) -> bool:
    """Whether every row's processing is the same whatever the drafts before it: no penalties, min_tokens
    already met, no prefix-dependent masks (bad words, grammar). allowed_token_ids / logit_bias may stay."""
    p = state.params
    return p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 \
        and p.min_tokens <= len(state.output_token_ids) and not state.bad_words_token_ids and state.grammar is None


class _TentativeGrammar:
    """Advances a request's grammar over accepted drafts and undoes exactly that on `restore`."""

    def __init__(self, grammar) -> None:
        self.grammar, self.steps = grammar, 0

    def accept(self, token: int) -> bool:
        """Advance over an accepted draft; True if the grammar has now terminated (the block ends)."""
        if self.grammar is None:
            return False
        if self.grammar.try_accept(token):
            self.steps += 1
        return self.grammar.terminated

    def restore(self) -> None:
        if self.steps:
            self.grammar.rollback(self.steps)
            self.steps = 0


def verify(target_logits: Tensor, drafts: Sequence[int], state: SamplingState, eos_token_ids: set[int],
           first_position: int, seed: int, draft_logits: Tensor | None = None) -> VerifyResult:
    """One request: target_logits [n+1, V] (raw), drafts [n]; first_position = position of row 0's token.

    draft_logits [n, V]: the draft's pre-temperature logits when it sampled (probabilistic draft);
    None means a greedy draft (q one-hot). `state.grammar` is left as it was (see the module doc).
    """
    logits = target_logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    if state.params.is_greedy and _position_free(state):      # one batched argmax over every row
        rows = logits
        if has_constraints(state.params):
            rows = apply_token_constraints(logits, [state] * logits.shape[0])
        tokens = []
        for i, t in enumerate(rows.argmax(dim=-1).tolist()):
            tokens.append(t)
            if i == len(drafts) or drafts[i] != t:
                break
        return _result(raw, tokens, len(tokens) - 1, state)
    grammar = _TentativeGrammar(state.grammar)
    try:
        tokens, accepted = _verify_rows(logits, drafts, state, eos_token_ids, first_position, seed, draft_logits,
                                        grammar)
    finally:
        grammar.restore()
    return _result(raw, tokens, accepted, state)


def _verify_rows(logits: Tensor, drafts: Sequence[int], state: SamplingState, eos: set[int], first_position: int,
                 seed: int, draft_logits: Tensor | None, grammar: _TentativeGrammar) -> tuple[list[int], int]:
    """Row by row: (emitted tokens, number of accepted drafts)."""
    tokens: list[int] = []
    for i in range(len(drafts) + 1):
        view = _row_state(state, tokens)
        row = _process_row(logits[i], view, eos)
        d = drafts[i] if i < len(drafts) else None
        q = None if d is None or draft_logits is None else _draft_probs(draft_logits[i], state)
        token, accepted = _decide(row, d, q, view, position_generator(seed, first_position + i + 1, STREAM_ACCEPT))
        tokens.append(token)
        if not accepted:
            return tokens, i
        if grammar.accept(token):
            return tokens, len(tokens)
    raise AssertionError("unreachable: the bonus row never accepts")


def _decide(row: Tensor, d: int | None, q: Tensor | None, view: SamplingState,
            gen: torch.Generator) -> tuple[int, bool]:
    """(token, whether it is the accepted draft) for one processed row; d None: the bonus row.

    q: the draft's distribution at this position, None for a greedy draft (one-hot on d)."""
    if view.params.is_greedy:
        t = int(row.argmax())
        return t, t == d
    p = sampling_probs(row[None], [view])[0]
    if d is None:
        return int(exponential_race(p[None], [gen])[0]), False
    if q is None:
        q = torch.zeros_like(p)
        q[d] = 1.0
    if float(torch.rand((), generator=gen)) * float(q[d]) < float(p[d]):
        return d, True
    residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:               # p == q up to rounding: any p-sample is exact
        residual = p
    return int(exponential_race((residual / residual.sum())[None], [gen])[0]), False


def _draft_probs(logits: Tensor, state: SamplingState) -> Tensor:
    return torch.softmax(logits.float() / state.params.temperature, dim=-1)


def _result(raw: Tensor, tokens: list[int], accepted: int, state: SamplingState) -> VerifyResult:
    rows = torch.arange(len(tokens))
    chosen = raw[rows, torch.tensor(tokens)].tolist()
    n = state.params.logprobs
    if n is None:
        return VerifyResult(tokens, chosen, [None] * len(tokens), accepted)
    values, ids = raw[: len(tokens)].topk(min(n, raw.shape[1]), dim=-1)
    tops: list[list[tuple[int, float]] | None] = [
        list(zip(i, v, strict=False)) for i, v in zip(ids.tolist(), values.tolist(), strict=False)]
    return VerifyResult(tokens, chosen, tops, accepted)


def sample_draft(logits: Tensor, temperature: float, seed: int, position: int) -> int:
    """A probabilistic draft's token at `position` (Gumbel/exponential race at the request temperature)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(exponential_race(probs[None], [position_generator(seed, position, STREAM_DRAFT)])[0])
