"""Per-request token constraints on the logits: `allowed_token_ids`, `bad_words`, `logit_bias`.

`apply_token_constraints` is the one per-request token-mask hook: the sampler calls it on every
step, and a speculative verifier (DSpark) calls it on each draft position's logits with a state
whose `output_token_ids` include the draft tokens before that position (bad words depend on the
tokens just generated), so constrained requests accept exactly the tokens greedy decoding would
choose. A grammar mask (structured output) belongs here as one more constraint.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from shared.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class ConstrainedRow(Protocol):
    params: SamplingParams
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]]


def bad_words_token_ids(bad_words: Sequence[str], encode) -> list[list[int]]:
    """Each word as is and after a space (vLLM's rule), deduplicated, in order."""
    seen: list[list[int]] = []
    for word in bad_words:
        for variant in (word, " " + word.lstrip(" ")):
            ids = encode(variant)
            if ids and ids not in seen:
                seen.append(ids)
    return seen


def has_constraints(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids is not None or params.bad_words)


def apply_token_constraints(logits: Tensor, rows: Sequence[ConstrainedRow]) -> Tensor:
    """`logits` [B, V] with each row's constraints applied (a new tensor when any row has some)."""
    if not any(has_constraints(r.params) or getattr(r, "grammar", None) is not None for r in rows):
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        grammar = getattr(r, "grammar", None)
        if grammar is not None:
            grammar.mask(logits[i])
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[torch.tensor(p.allowed_token_ids, device=logits.device)] = True
            logits[i].masked_fill_(~keep, _NEG_INF)
        for ids in r.bad_words_token_ids:
            prefix, last = ids[:-1], ids[-1]
            if not prefix or r.output_token_ids[-len(prefix):] == prefix:
                logits[i, last] = _NEG_INF
        if p.logit_bias:
            index = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i].index_add_(0, index, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                         device=logits.device))
    return logits
