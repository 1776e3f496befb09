"""Token ids of prompt pieces every chat render repeats, reused exactly.

A K3 chat render encodes every tag, attribute and text piece on its own (`shared.prompt.chat`): a
plain message is eight encodes of the same short texts (`message`, ` role`, `="`, `user`, ...), and
every request carries the same synthesized pieces (the thinking-effort note, the tool declarations
an agent sends each turn, the generation prompt). The router renders every prompt it places, for
prefix hashes, and these encodes were a quarter of its CPU per request
(benchmarks/router_overhead.py). Message contents are left to the tokenizer's segment memo
(`shared.prompt.token_memo`), which already reuses repeated text; keeping whole unique messages here
would cost memory for pieces that never come back.

Every piece is encoded on its own, so its ids do not depend on what comes before it: a hit is
exact, never a guess. Bounded (cleared when full); safe to share between threads.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

SHORT_CHARS = 48                  # texts up to this long (tags, attributes, names) are kept as pieces
MAX_SHORT = 8192                  # short pieces held; then cleared
MAX_UNITS = 1 << 20               # key characters + ids of keyed pieces held; then cleared


class RenderMemo:
    def __init__(self, max_units: int = MAX_UNITS, max_short: int = MAX_SHORT) -> None:
        self.max_units, self.max_short = max_units, max_short
        self._short: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[Hashable, tuple[int, ...]] = {}
        self._units = 0

    def encode_short(self, text: str, encode: Callable[[str], list[int]]) -> tuple[int, ...]:
        """`encode(text)` for a short text (at most SHORT_CHARS): one dict lookup once seen."""
        ids = self._short.get(text)
        if ids is None:
            if len(self._short) >= self.max_short:
                self._short = {}
            ids = self._short[text] = tuple(encode(text))
        return ids

    def get(self, key: Hashable) -> tuple[int, ...] | None:
        """The ids of a keyed piece (`put`), if held."""
        return self._pieces.get(key)

    def put(self, key: Hashable, ids: list[int], key_chars: int) -> None:
        """Remember `ids` for `key`, whose text is `key_chars` long (counted in the bound). A piece
        larger than an eighth of the bound is not kept (it would clear the rest)."""
        units = key_chars + len(ids)
        if units > self.max_units // 8:
            return
        if self._units + units > self.max_units:
            self._pieces, self._units = {}, 0
        self._pieces[key] = tuple(ids)
        self._units += units

    def __len__(self) -> int:
        return len(self._short) + len(self._pieces)
