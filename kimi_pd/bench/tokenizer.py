"""The tokenizer the benchmark builds prompts with, and the pool of tokens it builds them from.

Prompts are made of real tokens of the served model's tokenizer so the server sees the requested
input length. The pool holds single-token lowercase words with a leading space (" the", " of", ...):
the pre-tokenizer splits text before every space, so any sequence of pool tokens decodes to text
that encodes back to exactly that sequence - no decode/re-encode drift, no cross-block merges
(which keeps Mooncake blocks with equal hash ids equal as token prefixes on the server).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_WORD = re.compile(rb" [a-z]{1,12}")
MIN_POOL = 16


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A Kimi tokenizer directory (`tiktoken.model` + config), as written by `kimi-pd checkpoint create`."""
    from shared.prompt.tokenizer import KimiTokenizer
    path = Path(path)
    if not (path / "tiktoken.model").is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tiktoken.model there (give a checkpoint directory)")
    return KimiTokenizer.from_dir(path)


@dataclass(frozen=True)
class TokenPool:
    """Token ids that concatenate without merging, and the tokenizer they belong to."""

    tokenizer: Tokenizer
    ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenPool:
        ids = []
        for i in range(getattr(tokenizer, "num_ranks", 0)):
            text = tokenizer.decode([i])
            if _WORD.fullmatch(text.encode()) and tokenizer.encode(text) == [i]:
                ids.append(i)
        if len(ids) < MIN_POOL:
            raise ValueError(f"the tokenizer has only {len(ids)} single-token words; cannot build prompts")
        return cls(tokenizer, tuple(ids))

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
