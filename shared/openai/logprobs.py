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


# (token_id, logprob, rank, top [(id, logprob), ...]) per prompt position, None at position 0
PromptScores = Sequence[tuple[int, float, int, Sequence[tuple[int, float]]] | None]


def prompt_logprobs_body(scores: PromptScores, token_text: TokenText) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per position None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and its top-n alternatives (ranks 1..n)."""
    body: list[dict[str, dict] | None] = []
    for entry in scores:
        if entry is None:
            body.append(None)
            continue
        token_id, logprob, rank, top = entry
        ranked = {i: (lp, r) for r, (i, lp) in enumerate(top, start=1)}
        ranked[token_id] = (logprob, rank)
        body.append({str(i): {"logprob": _finite(lp), "rank": r, "decoded_token": token_text(i)}
                     for i, (lp, r) in ranked.items()})
    return body


def echo_logprobs(prompt_ids: Sequence[int], scores: PromptScores, top_n: int,
                  token_text: TokenText) -> CompletionLogprobs:
    """The prompt part of an echoed completion's logprobs: the first token has none (null), the
    others their logprob and, with `top_n`, that many alternatives plus the token itself."""
    out = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_ids, scores, strict=True):
        text = token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        _, logprob, _, top = entry
        out.token_logprobs.append(_finite(logprob))
        out.top_logprobs.append(_top_dict(list(top)[:top_n], text, logprob, token_text))
    return out


def concat_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """`b` after `a` (b's offsets are already absolute)."""
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)
