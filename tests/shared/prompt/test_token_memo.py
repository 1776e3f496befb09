"""The segment memo gives exactly the ids of encoding the whole text, cold and warm."""
from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.prompt.token_memo import SegmentMemo, cut_points
from shared.prompt.tokenizer import KimiTokenizer

TOK = KimiTokenizer.generated()
ENCODE = TOK._enc.encode_ordinary            # the reference: tiktoken on the whole text at once
# letters of several scripts, combining marks, digits, spaces of every kind, punctuation, apostrophes
ALPHABET = "abcXYZ é\u0301ßİ中文日本 \t\n\r\u00a0\u3000'.,!?-_()\"0123456789😀"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=400), st.text(alphabet=ALPHABET, max_size=200),
       st.integers(min_value=1, max_value=40))
def test_any_text_and_its_extensions_encode_as_a_whole(prefix: str, suffix: str, stride: int) -> None:
    memo = SegmentMemo(stride=stride)
    for text in (prefix, prefix + suffix, prefix, suffix + prefix, prefix + suffix):   # cold, then warm
        assert memo.encode(text, ENCODE) == ENCODE(text)


def test_cuts_are_letter_space_positions_one_stride_apart() -> None:
    text = "alpha beta, gamma  delta! epsilon zeta eta theta"
    cuts = cut_points(text, 8)
    assert cuts and all(text[c] == " " and text[c - 1].isalpha() for c in cuts)
    assert all(b - a >= 8 for a, b in itertools.pairwise(cuts)) and cuts[0] >= 8


def test_a_shared_prefix_is_encoded_once_then_reused() -> None:
    rng = random.Random(7)
    words = " ".join(rng.choice(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]) for _ in range(900))
    calls: list[str] = []

    def counting(segment: str) -> list[int]:
        calls.append(segment)
        return ENCODE(segment)

    memo = SegmentMemo()
    for i in range(5):
        text = f"{words} (request {i})"
        calls.clear()
        assert memo.encode(text, counting) == ENCODE(text)
        last_cut = cut_points(text)[-1]
        # the first request encodes everything; later ones only what follows the last shared cut
        assert sum(map(len, calls)) == (len(text) if i == 0 else len(text) - last_cut)
        assert len(words) - last_cut < 1100


def test_the_memo_is_bounded_and_stays_exact_when_it_starts_over() -> None:
    rng = random.Random(3)
    memo = SegmentMemo(max_chars=5000, stride=64)
    for _ in range(60):
        text = _text(rng, rng.randrange(0, 3000))
        assert memo.encode(text, ENCODE) == ENCODE(text)
        assert memo._chars <= 5000


def test_the_tokenizer_encodes_through_the_memo_with_equal_ids() -> None:
    text = "The system prompt says hello. " * 100 + "A new question?"
    assert TOK.encode(text) == ENCODE(text) == TOK.encode(text)
