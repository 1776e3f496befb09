"""A small, deterministic byte-level BPE trainer that writes tiktoken mergeable ranks.

Real Kimi tokenizers cannot be shipped, so the generated checkpoints carry a tokenizer trained here.
It uses the Kimi-K2/K3 pre-tokenizer (`PAT_STR`), so text splits into the same pieces as on the
real model, and writes the HF Kimi `tiktoken.model` layout (`base64(token bytes) rank` per line).

Ranks 0..255 are the single bytes (rank == byte value); every later rank is one merge, in training
order. Ties between equally frequent pairs go to the pair whose byte strings sort first, so the same
corpus always gives the same file.

    python -m shared.prompt.bpe_train --out shared/prompt/data/tiktoken.model --ranks 1024
"""
from __future__ import annotations

import argparse
import base64
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex

# The Kimi-K2 `tokenization_kimi.py` split pattern (K3 uses the same one), in tiktoken syntax. The
# `&&` class intersections need the `regex` module's V1 mode when used from Python (`compile_pattern`).
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_BYTE_RANKS = 256
DEFAULT_CORPUS = Path(__file__).parent / "data" / "corpus.txt"

Pair = tuple[int, int]


def compile_pattern() -> regex.Pattern[str]:
    """`PAT_STR` for Python's `regex` module (V1 enables the `&&` set intersection tiktoken uses)."""
    return regex.compile(PAT_STR, flags=regex.V1)


def pretokenize(text: str) -> Counter[bytes]:
    """Pieces the BPE never merges across, with their counts."""
    return Counter(piece.encode("utf-8") for piece in compile_pattern().findall(text))


class _Merger:
    """Pair statistics over the distinct pieces, updated incrementally after each merge."""

    def __init__(self, pieces: Counter[bytes]) -> None:
        self.words: list[list[int]] = [list(piece) for piece in pieces]
        self.counts: list[int] = list(pieces.values())
        self.pair_counts: Counter[Pair] = Counter()
        self.where: dict[Pair, set[int]] = {}
        for idx in range(len(self.words)):
            self._add(idx, +1)

    def _add(self, idx: int, sign: int) -> None:
        word, count = self.words[idx], self.counts[idx]
        for pair in zip(word, word[1:], strict=False):
            self.pair_counts[pair] += sign * count
            if sign > 0:
                self.where.setdefault(pair, set()).add(idx)
            elif self.pair_counts[pair] <= 0:
                del self.pair_counts[pair]

    def best_pair(self, token_bytes: list[bytes]) -> Pair | None:
        """Most frequent pair; ties broken by the pair's byte strings, for determinism."""
        if not self.pair_counts:
            return None
        top = max(self.pair_counts.values())
        tied = (pair for pair, count in self.pair_counts.items() if count == top)
        return min(tied, key=lambda p: (token_bytes[p[0]], token_bytes[p[1]]))

    def merge(self, pair: Pair, new_id: int) -> None:
        for idx in self.where.pop(pair, set()):
            word = self.words[idx]
            if not any(a == pair[0] and b == pair[1] for a, b in zip(word, word[1:], strict=False)):
                continue  # stale index: an earlier merge already consumed this occurrence
            self._add(idx, -1)
            self.words[idx] = _merge_word(word, pair, new_id)
            self._add(idx, +1)


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(text: str, num_ranks: int) -> dict[bytes, int]:
    """Train on `text` until there are exactly `num_ranks` ranks; returns tiktoken mergeable ranks."""
    if num_ranks < NUM_BYTE_RANKS:
        raise ValueError(f"num_ranks must be >= {NUM_BYTE_RANKS}, got {num_ranks}")
    token_bytes = [bytes([b]) for b in range(NUM_BYTE_RANKS)]
    ranks = {tok: rank for rank, tok in enumerate(token_bytes)}
    merger = _Merger(pretokenize(text))
    while len(ranks) < num_ranks:
        pair = merger.best_pair(token_bytes)
        if pair is None:
            raise ValueError(f"corpus too small: only {len(ranks)} ranks can be learned, {num_ranks} requested")
        merged = token_bytes[pair[0]] + token_bytes[pair[1]]
        # Two different splits can build the same bytes; reuse the existing rank instead of a duplicate.
        if merged not in ranks:
            ranks[merged] = len(ranks)
            token_bytes.append(merged)
        merger.merge(pair, ranks[merged])
    return ranks


def dump_tiktoken_model(ranks: dict[bytes, int]) -> str:
    """The HF Kimi `tiktoken.model` text: `base64(bytes) rank` per line, in rank order."""
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    return "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in by_rank)


def parse_tiktoken_model(lines: Iterable[str]) -> dict[bytes, int]:
    """Inverse of `dump_tiktoken_model`; rejects duplicate ranks or tokens and non-dense ranks."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            b64, rank_text = line.split()
            tok, rank = base64.b64decode(b64, validate=True), int(rank_text)
        except ValueError as exc:
            raise ValueError(f"tiktoken.model line {lineno} is not 'base64 rank': {line.strip()!r}") from exc
        if tok in ranks:
            raise ValueError(f"tiktoken.model line {lineno}: token {tok!r} appears twice")
        ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tiktoken.model ranks must be exactly 0..N-1")
    return ranks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write tiktoken.model")
    parser.add_argument("--ranks", type=int, default=1024, help="total BPE ranks, including the 256 bytes")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="UTF-8 training text")
    args = parser.parse_args(argv)
    ranks = train_bpe(args.corpus.read_text(encoding="utf-8"), args.ranks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_tiktoken_model(ranks), encoding="ascii")
    print(f"wrote {len(ranks)} ranks to {args.out}")


if __name__ == "__main__":
    main()
