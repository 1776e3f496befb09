"""Per-request sampling parameters, with vLLM's names, defaults and accepted ranges.

`SamplingParams(...)` only normalises shapes (a single stop string becomes a list); `validate`
checks every value and raises `InvalidSamplingParams` naming the field and its allowed range, so the
API layer can call it once and map the error to a 400.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from shared.errors import InvalidSamplingParams
from shared.structured_output import StructuredOutput

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# vLLM's default max_logprobs; also OpenAI's top_logprobs limit.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 128                 # sequences per prompt (n, best_of)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class _Interval:
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"


_INF = math.inf
_FLOAT_RANGES = {
    "temperature": _Interval(0, _INF, hi_open=True),
    "top_p": _Interval(0, 1, lo_open=True),
    "min_p": _Interval(0, 1),
    "presence_penalty": _Interval(-2, 2),
    "frequency_penalty": _Interval(-2, 2),
    "repetition_penalty": _Interval(0, _INF, lo_open=True, hi_open=True),
}
# name -> (allowed range, None allowed, hint appended to the message)
_INT_RANGES: dict[str, tuple[_Interval, bool, str]] = {
    "top_k": (_Interval(-1, _INF, hi_open=True), False, " (0 or -1 disables top-k)"),
    "max_tokens": (_Interval(0, _INF, hi_open=True), True, " (0: score the prompt only)"),
    "min_tokens": (_Interval(0, _INF, hi_open=True), False, ""),
    "logprobs": (_Interval(0, MAX_LOGPROBS), True, " (the number of top alternatives to return)"),
    "prompt_logprobs": (_Interval(0, MAX_LOGPROBS), True, " (the number of top alternatives per prompt token)"),
    "seed": (_Interval(INT64_MIN, INT64_MAX), True, ""),
}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


@dataclass
class SamplingParams:
    """How one request samples and when it stops; vLLM's names and defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16         # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n alternatives besides the sampled token
    prompt_logprobs: int | None = None  # per prompt token: its logprob and rank, plus top-n alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1                          # sequences per prompt; `LLM` and the servers fan them out
    logit_bias: dict[int, float] | None = None      # added to the token's logit before choosing ([-100, 100])
    allowed_token_ids: list[int] | None = None      # only these ids may be chosen
    bad_words: list[str] = field(default_factory=list)   # never completed (as is and after a space)
    structured_output: StructuredOutput | None = None     # the output must match it (json, regex, ...)
    cache_salt: str | None = None       # prefix-cache isolation: only equal salts share blocks
    priority: int = 0                   # vLLM's: lower first under --scheduling-policy priority (else unused)
    # vLLM's repetition_detection (max_pattern_size, min_pattern_size, min_count): the output ends
    # ("repetition") once its last tokens are one pattern of that size repeated min_count times
    repetition_detection: tuple[int, int, int] | None = None

    def for_sequence(self, index: int) -> SamplingParams:
        """The params of sequence `index` of n: one sequence, its own seed (seed + index) when seeded."""
        from dataclasses import replace
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    def __post_init__(self) -> None:
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.bad_words = _as_list(self.bad_words)

    def repeats(self, output_token_ids: Sequence[int]) -> bool:
        """`repetition_detection` fires on these outputs (never within `min_tokens`, as in vLLM)."""
        detect = self.repetition_detection
        return detect is not None and len(output_token_ids) >= self.min_tokens and \
            repetition_detected(output_token_ids, *detect)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Ids that end generation: `stop_token_ids`, plus the eos ids unless `ignore_eos`."""
        ids = set(self.stop_token_ids)
        return ids if self.ignore_eos else ids | set(eos_token_ids)

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidSamplingParams` for the first field that is out of range or mistyped."""
        for name, interval in _FLOAT_RANGES.items():
            _check_float(name, getattr(self, name), interval)
        for name, (interval, optional, hint) in _INT_RANGES.items():
            _check_int(name, getattr(self, name), interval, optional, hint)
        for name in _BOOL_FIELDS:
            _check_bool(name, getattr(self, name))
        _check_n(self.n)
        _check_min_tokens(self.min_tokens, self.max_tokens)
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        _check_token_constraints(self, vocab_size)


def _as_list(value: Any) -> Any:
    """A str becomes a one-element list, None an empty one; other non-lists are left for `validate`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value) if isinstance(value, (list, tuple)) else value


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, message: str) -> NoReturn:
    raise InvalidSamplingParams(f"{name} {message}", param=name)


def _check_float(name: str, value: Any, interval: _Interval) -> None:
    is_number = _is_int(value) or (isinstance(value, float) and not math.isnan(value))
    if not is_number or value not in interval:
        _fail(name, f"must be a number in {interval}, got {value!r}")


def _check_int(name: str, value: Any, interval: _Interval, optional: bool, hint: str) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value not in interval:
        _fail(name, f"must be {'None or ' if optional else ''}an integer in {interval}{hint}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, f"must be true or false, got {value!r}")


def _check_n(n: Any) -> None:
    if not _is_int(n) or not 1 <= n <= MAX_N:
        _fail("n", f"must be an integer in [1, {MAX_N}], got {n!r}")


def _check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        _fail("min_tokens", f"must be at most max_tokens ({max_tokens}), got {min_tokens}")


def _check_stop(stop: Any) -> None:
    if not isinstance(stop, list):
        _fail("stop", f"must be a string or a list of strings, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        _fail("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            _fail("stop", f"must contain only non-empty strings, got {s!r}")


def _check_stop_token_ids(ids: Any, vocab_size: int) -> None:
    if not isinstance(ids, list):
        _fail("stop_token_ids", f"must be a list of integers, got {ids!r}")
    bad = [i for i in ids if not _is_int(i) or not 0 <= i < vocab_size]
    if bad:
        _fail("stop_token_ids", f"must contain only token ids in [0, {vocab_size}), got {bad!r}")


MAX_LOGIT_BIAS = 100.0


def _check_token_constraints(params: SamplingParams, vocab_size: int) -> None:
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, dict):
            _fail("logit_bias", f"must map token ids to numbers, got {bias!r}")
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token < vocab_size:
                _fail("logit_bias", f"keys must be token ids in [0, {vocab_size}), got {token!r}")
            if not (_is_int(value) or isinstance(value, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                _fail("logit_bias", f"values must be numbers in [-100, 100], got {value!r}")
    allowed = params.allowed_token_ids
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            _fail("allowed_token_ids", f"must be a non-empty list of token ids, got {allowed!r}")
        bad = [i for i in allowed if not _is_int(i) or not 0 <= i < vocab_size]
        if bad:
            _fail("allowed_token_ids", f"must contain only token ids in [0, {vocab_size}), got {bad[:8]!r}")
    if not isinstance(params.bad_words, list) or not all(isinstance(w, str) and w for w in params.bad_words):
        _fail("bad_words", f"must be a list of non-empty strings, got {params.bad_words!r}")


def repetition_detected(token_ids: Sequence[int], max_pattern_size: int, min_pattern_size: int, min_count: int) -> bool:
    """vLLM's repetition detection: the last tokens are one pattern of `min_pattern_size..max_pattern_size`
    tokens repeated `min_count` times in a row."""
    for size in range(max(min_pattern_size, 1), max_pattern_size + 1):
        if size * min_count > len(token_ids):
            return False
        tail = token_ids[-size:]
        if all(token_ids[-size * (k + 1):len(token_ids) - size * k] == tail for k in range(1, min_count)):
            return True
    return False
