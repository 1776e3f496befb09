"""Streaming token -> text for one request, with stop strings, stop tokens and eos.

Text is built from token BYTES through an incremental UTF-8 decoder, so a character split across
tokens is emitted only once complete, and the result equals `tokenizer.decode` of the same ids.
Three positions in the decoded text matter:

    _text:  |------ emitted ------|--- held back ---|        (+ undecoded bytes in the decoder)
                                  ^ _emitted        ^ len(_text)

Held back is the longest suffix that could still grow into a stop string; it is released once it
cannot, or by `finish()`. So a streamed prefix is never later cut: the concatenation of every
`new_text` (and `finish()`) is exactly the final `text`.

As in vLLM, no stop condition applies to the first `min_tokens` tokens, and a stop/eos token's own
text is left out unless `include_stop_str_in_output`.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from shared.prompt.tokenizer import KimiTokenizer
from shared.sampling_params import SamplingParams

StopKind = Literal["stop_string", "stop_token", "eos"]


@dataclass(frozen=True)
class StopReason:
    kind: StopKind
    value: str | int        # the stop string, or the token id that stopped generation


@dataclass(frozen=True)
class DetokenizerStep:
    new_text: str
    stopped: StopReason | None = None


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamed text; one instance per request."""

    def __init__(self, tokenizer: KimiTokenizer, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self._stop_ids = set(params.stop_token_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._emitted = 0
        self._num_tokens = 0
        self._done = False
        self.stopped: StopReason | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far; the final text once stopped or finished."""
        return self._text[:self._emitted]

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, token_id: int) -> DetokenizerStep:
        """Consume one sampled token; the returned step's `stopped` is set when this token ends generation.

        Raises RuntimeError after a stop or `finish()`, and ValueError for an id outside the vocabulary.
        """
        if self._done:
            raise RuntimeError("the detokenizer has already stopped or finished; no more tokens can be added")
        self._num_tokens += 1
        reason = self._token_stop(token_id)
        if reason is not None:
            return self._stop_on_token(token_id, reason)
        return self._advance(self._decoder.decode(self._bytes_of(token_id)))

    def finish(self) -> str:
        """End of generation for another reason (length, abort): release held-back text, flush
        undecodable trailing bytes as U+FFFD. Returns the last piece of text ("" if already stopped)."""
        if self._done:
            return ""
        step = self._advance(self._decoder.decode(b"", final=True), final=True)
        self._done = True
        return step.new_text

    # ---- stop conditions ---------------------------------------------------------------------

    def _stops_active(self) -> bool:
        return self._num_tokens > self._params.min_tokens

    def _token_stop(self, token_id: int) -> StopReason | None:
        if not self._stops_active():
            return None
        if token_id in self._eos_ids:
            return StopReason("eos", token_id)
        if token_id in self._stop_ids:
            return StopReason("stop_token", token_id)
        return None

    def _stop_on_token(self, token_id: int, reason: StopReason) -> DetokenizerStep:
        """Stop now: the token's own text only with include_stop_str_in_output, then flush everything."""
        tail = self._bytes_of(token_id) if self._params.include_stop_str_in_output else b""
        self._text += self._decoder.decode(tail, final=True)
        return self._stop(len(self._text), reason)

    def _find_stop_string(self, old_len: int) -> tuple[int, str] | None:
        """The (start, stop) occurrence ending in the text added after `old_len` that ends first
        (ties: the one starting first), i.e. the one a character-by-character stream would meet."""
        hits = []
        for stop in self._params.stop:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                hits.append((start, stop))
        return min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]), default=None)

    def _stop(self, cut: int, reason: StopReason) -> DetokenizerStep:
        self._text = self._text[:cut]
        new_text = self._emit(cut)
        self.stopped, self._done = reason, True
        return DetokenizerStep(new_text, reason)

    # ---- text --------------------------------------------------------------------------------

    def _bytes_of(self, token_id: int) -> bytes:
        if self._params.skip_special_tokens and self._tokenizer.is_special(token_id):
            return b""
        return self._tokenizer.token_bytes(token_id)

    def _advance(self, new_chars: str, final: bool = False) -> DetokenizerStep:
        """Append decoded text, stop at a completed stop string, else emit all but the held-back suffix."""
        old_len = len(self._text)
        self._text += new_chars
        hit = self._find_stop_string(old_len) if self._stops_active() else None
        if hit is not None:
            start, stop = hit
            cut = start + len(stop) if self._params.include_stop_str_in_output else start
            return self._stop(cut, StopReason("stop_string", stop))
        held = 0 if final else self._holdback()
        return DetokenizerStep(self._emit(len(self._text) - held))

    def _holdback(self) -> int:
        """Length of the longest unemitted suffix that is a proper prefix of a stop string.

        With include_stop_str_in_output nothing before a stop string is ever cut, so nothing is held.
        """
        if self._params.include_stop_str_in_output:
            return 0
        pending = self._text[self._emitted:]
        return max((_overlap(pending, stop) for stop in self._params.stop), default=0)

    def _emit(self, end: int) -> str:
        new_text = self._text[self._emitted:end]
        self._emitted = end
        return new_text


def _overlap(text: str, stop: str) -> int:
    """Longest n < len(stop) with text ending in stop[:n]."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
