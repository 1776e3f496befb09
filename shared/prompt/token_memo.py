"""Token ids of text already seen, reused exactly: prompts repeat most of their text.

A chat render encodes a dozen tag and attribute strings per message, the same ones every time, and
real traffic repeats long prefixes (system prompts, earlier turns, shared documents) - the router
renders and tokenises every prompt it places. tiktoken encodes each pre-token (a match of
`PAT_STR`) on its own, so a text cut where a pre-token must end encodes as the concatenation of
its parts. A cut before a space that follows a letter is such a place: no alternative of `PAT_STR`
matches a letter followed by a space (a space only ever leads a match), and the pattern looks
ahead, never behind. `cut_points` picks one such cut at or after every `STRIDE` characters, the
same cuts for every text that shares the prefix before them; `SegmentMemo` keys each segment by
the node of the text before it plus the segment's own text, so a hit is exact, never a guess.
"""
from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable

STRIDE = 1024                     # characters between cut points (at least)
MAX_CHARS = 4 << 20               # segment text held (about 4 MiB plus 4 bytes per token); then cleared


def cut_points(text: str, stride: int = STRIDE) -> list[int]:
    """Ascending cuts (0 < cut < len(text)): the first `letter|space` position at or after each
    multiple of `stride` past the previous cut."""
    cuts, at = [], stride
    while at < len(text):
        b = text.find(" ", at)
        while b > 0 and not text[b - 1].isalpha():
            b = text.find(" ", b + 1)
        if b <= 0:
            break
        cuts.append(b)
        at = b + stride
    return cuts


class SegmentMemo:
    """(node of the preceding text, segment text) -> (node, token ids); node 0 is the empty text.

    Bounded by the characters it holds: when full it starts again empty (node ids are never
    reused, so a lookup that raced a clear just misses). Safe to share between threads."""

    def __init__(self, max_chars: int = MAX_CHARS, stride: int = STRIDE) -> None:
        self.max_chars, self.stride = max_chars, stride
        self._segments: dict[tuple[int, str], tuple[int, array]] = {}
        self._chars = 0
        self._nodes = itertools.count(1)

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`encode(text)`, from memoised segments where they are known."""
        out: list[int] = []
        node, start = 0, 0
        for end in [*cut_points(text, self.stride), len(text)]:
            segment = text[start:end]
            hit = self._segments.get((node, segment))
            if hit is None:
                ids = encode(segment)
                node = self._put(node, segment, ids)
                out += ids
            else:
                node, ids_array = hit
                out += ids_array
            start = end
        return out

    def _put(self, parent: int, segment: str, ids: list[int]) -> int:
        if self._chars + len(segment) > self.max_chars:
            self._segments, self._chars = {}, 0
        node = next(self._nodes)
        self._segments[(parent, segment)] = (node, array("I", ids))
        self._chars += len(segment)
        return node

    def __len__(self) -> int:
        return len(self._segments)
