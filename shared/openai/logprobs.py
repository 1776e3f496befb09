"""Engine logprobs (token ids, sampled logprobs, top-n `(id, logprob)` lists) in OpenAI's shapes.

A `-inf` or NaN logprob becomes -9999.0, as in vLLM: JSON cannot carry it and clients expect a
number. Top lists are the engine's n most likely tokens, best first: the chat shape lists exactly
those, the completions shape adds the sampled token to them (up to n + 1 entries, as OpenAI
documents for `logprobs`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from shared.openai.responses import ChatLogprob, ChatLogprobs, CompletionLogprobs, TopLogprob

LOGPROB_FLOOR = -9999.0
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]
TopList = Sequence[tuple[int, float]] | None


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _tops(top_logprobs: Sequence[TopList] | None, n: int) -> Sequence[TopList]:
    return [None] * n if top_logprobs is None else top_logprobs


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], top_logprobs: Sequence[TopList] | None,
                  token_text: TokenText, token_bytes: TokenBytes | None = None) -> ChatLogprobs:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`, one entry per token.

    `bytes` are the token's own bytes when `token_bytes` is given (a token may end inside a UTF-8
    character), else the UTF-8 encoding of its text.
    """
    def entry(token_id: int, logprob: float) -> TopLogprob:
        raw = token_bytes(token_id) if token_bytes else token_text(token_id).encode()
        return TopLogprob(token=token_text(token_id), logprob=_finite(logprob), bytes=list(raw))

    content = []
    for token_id, logprob, top in zip(token_ids, logprobs, _tops(top_logprobs, len(token_ids)), strict=True):
        alternatives = [entry(i, lp) for i, lp in top or ()]
        content.append(ChatLogprob(**entry(token_id, logprob).model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], top_logprobs: Sequence[TopList] | None,
                        token_text: TokenText, text_offset: int = 0) -> CompletionLogprobs:
    """Legacy completions logprobs; `text_offset` is where this piece starts in the choice's text.

    A top entry is None where no alternatives were asked for; if two ids decode to the same text,
    the better logprob is kept.
    """
    out = CompletionLogprobs()
    for token_id, logprob, top in zip(token_ids, logprobs, _tops(top_logprobs, len(token_ids)), strict=True):
        text = token_text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(logprob))
        out.text_offset.append(text_offset)
        out.top_logprobs.append(None if top is None else _top_dict(top, text, logprob, token_text))
        text_offset += len(text)
    return out


def _top_dict(top: Sequence[tuple[int, float]], sampled: str, sampled_logprob: float,
              token_text: TokenText) -> dict[str, float]:
    entries: dict[str, float] = {}
    for text, logprob in [*((token_text(i), lp) for i, lp in top), (sampled, sampled_logprob)]:
        entries[text] = max(entries.get(text, LOGPROB_FLOOR), _finite(logprob))
    return entries
