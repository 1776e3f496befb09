from __future__ import annotations

import random

import pytest

from shared.prompt.detokenizer import DetokenizerStep, IncrementalDetokenizer, StopReason
from shared.prompt.tokenizer import KimiTokenizer
from shared.sampling_params import SamplingParams

TOK = KimiTokenizer.generated()
EOS = TOK.eos_id
OPEN = TOK.id_of("<|open|>")


def detok(**kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOK, SamplingParams(**kwargs), {EOS})


def stream(d: IncrementalDetokenizer, ids: list[int]) -> list[DetokenizerStep]:
    """Feed ids until a stop; the last step is the `finish()` text when nothing stopped."""
    steps = []
    for token_id in ids:
        steps.append(d.add(token_id))
        if steps[-1].stopped:
            return steps
    steps.append(DetokenizerStep(d.finish()))
    return steps


def streamed_text(steps: list[DetokenizerStep]) -> str:
    return "".join(step.new_text for step in steps)


# ---- UTF-8 across tokens --------------------------------------------------------------------------

MULTIBYTE = ["你好，世界", "😀🎉 ok", "mixed 中文 and emoji 👩\u200d💻!", "ünïcödé ça va"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_chars_split_across_tokens_are_never_emitted_partially(text):
    ids = TOK.encode(text)
    assert any(_is_partial(TOK.token_bytes(i)) for i in ids), "the case must really split a character"
    d = detok()
    steps = stream(d, ids)
    assert all("\ufffd" not in step.new_text for step in steps)
    assert streamed_text(steps) == d.text == TOK.decode(ids) == text


def _is_partial(token: bytes) -> bool:
    try:
        token.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_character_is_emitted_by_the_token_that_completes_it():
    ids = TOK.encode("你好")                          # 3 single-byte tokens per character
    assert len(ids) == 6
    assert [step.new_text for step in stream(detok(), ids)] == ["", "", "你", "", "", "好", ""]


def test_incomplete_tail_flushes_as_replacement_on_finish():
    ids = TOK.encode("ok你")[:-1]
    d = detok()
    assert streamed_text([d.add(i) for i in ids]) == "ok"
    assert d.finish() == "\ufffd"
    assert d.text == TOK.decode(ids) == "ok\ufffd"


@pytest.mark.parametrize("seed", range(20))
def test_random_token_streams_equal_one_shot_decode(seed):
    """Arbitrary ids, invalid byte sequences and skipped specials included."""
    rng = random.Random(seed)
    ids = [rng.choice([rng.randrange(TOK.num_ranks), rng.randrange(256), OPEN]) for _ in range(30)]
    for skip in (True, False):
        d = detok(skip_special_tokens=skip)
        assert streamed_text(stream(d, ids)) == d.text == TOK.decode(ids, skip_special_tokens=skip)


# ---- special tokens -------------------------------------------------------------------------------

@pytest.mark.parametrize(("skip", "expected"), [(True, "hi there"), (False, "hi<|open|> there")])
def test_special_tokens_skipped_or_kept(skip, expected):
    ids = TOK.encode("hi") + [OPEN] + TOK.encode(" there")
    d = detok(skip_special_tokens=skip)
    assert streamed_text(stream(d, ids)) == expected == TOK.decode(ids, skip_special_tokens=skip)


# ---- stop strings ---------------------------------------------------------------------------------

STOP_TEXT = "stop here please"       # tokens: st|o|p| he|re| please...


@pytest.mark.parametrize(("stop", "include", "expected"), [
    ("p he", False, "sto"),             # spans three tokens
    ("p he", True, "stop he"),
    ("h", False, "stop "),              # inside one token: the rest of that token is cut too
    ("h", True, "stop h"),
    ("st", False, ""),                  # the very first token
    ("ease", True, STOP_TEXT),
    ("re pl", False, "stop he"),
])
def test_stop_string_cuts_exactly(stop, include, expected):
    d = detok(stop=[stop], include_stop_str_in_output=include)
    steps = stream(d, TOK.encode(STOP_TEXT))
    assert steps[-1].stopped == StopReason("stop_string", stop)
    assert streamed_text(steps) == d.text == expected
    assert d.finish() == ""


def test_stop_string_of_multibyte_chars_spanning_tokens():
    d = detok(stop=["世界"])
    steps = stream(d, TOK.encode("你好，世界！"))
    assert streamed_text(steps) == "你好，"
    assert steps[-1].stopped == StopReason("stop_string", "世界")


def test_held_back_prefix_is_released_when_it_does_not_complete():
    d = detok(stop=["p hx"])
    steps = stream(d, TOK.encode("stop here"))         # st|o|p| he|re
    assert [step.new_text for step in steps] == ["st", "o", "", "p he", "re", ""]
    assert all(step.stopped is None for step in steps)
    assert d.text == "stop here"


def test_finish_releases_held_back_text():
    d = detok(stop=["pq"])
    assert streamed_text([d.add(i) for i in TOK.encode("stop")]) == "sto"
    assert d.finish() == "p"
    assert d.text == "stop"


def test_include_stop_str_holds_nothing_back():
    d = detok(stop=["p hx"], include_stop_str_in_output=True)
    assert [step.new_text for step in stream(d, TOK.encode("stop here"))] == ["st", "o", "p", " he", "re", ""]


def test_stop_that_ends_first_wins():
    """One token (" wor") completes both; "wo" ends first although " wor" starts first."""
    d = detok(stop=[" wor", "wo"])
    steps = stream(d, TOK.encode("hello world"))        # he|ll|o| wor|l|d
    assert steps[-1].stopped == StopReason("stop_string", "wo")
    assert d.text == "hello "


@pytest.mark.parametrize("seed", range(30))
def test_random_stop_strings_match_reference(seed):
    """Streamed text equals the text cut at the first stop string to end, for any tokenisation."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", " ", "ab", "中", "ba "]) for _ in range(25))
    stops = ["".join(rng.choice("ab 中") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    d = detok(stop=stops, include_stop_str_in_output=include)
    steps = stream(d, TOK.encode(text))
    expected, stopped = _reference_cut(text, stops, include)
    assert streamed_text(steps) == d.text == expected
    assert steps[-1].stopped == stopped


def _reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, StopReason | None]:
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)                   # same end: the one starting first
            return text[:end] if include else text[:end - len(stop)], StopReason("stop_string", stop)
    return text, None


# ---- stop tokens and eos --------------------------------------------------------------------------

def test_eos_stops_and_its_text_is_left_out():
    d = detok(skip_special_tokens=False)
    steps = stream(d, TOK.encode("hello") + [EOS] + TOK.encode(" more"))
    assert steps[-1].stopped == StopReason("eos", EOS)
    assert d.text == "hello"


def test_ignore_eos_treats_eos_as_text():
    d = detok(ignore_eos=True, skip_special_tokens=False)
    steps = stream(d, TOK.encode("hi") + [EOS] + TOK.encode("!"))
    assert all(step.stopped is None for step in steps)
    assert d.text == "hi<|end_of_msg|>!"


@pytest.mark.parametrize(("include", "expected"), [(False, "hello"), (True, "hello wor")])
def test_stop_token_text_included_only_on_request(include, expected):
    ids = TOK.encode("hello world")                      # he|ll|o| wor|l|d
    d = detok(stop_token_ids=[ids[3]], include_stop_str_in_output=include, stop=["o wx"])
    steps = stream(d, ids)
    assert steps[-1].stopped == StopReason("stop_token", ids[3])
    assert streamed_text(steps) == d.text == expected   # held-back "o" is released at the stop


def test_stop_token_flushes_an_incomplete_character():
    d = detok()
    steps = stream(d, TOK.encode("a你")[:-1] + [EOS])
    assert steps[-1].stopped == StopReason("eos", EOS)
    assert d.text == "a\ufffd"


def test_no_stop_applies_before_min_tokens():
    ids = TOK.encode("stop here")                        # st|o|p| he|re
    d = detok(stop=["st", "re"], stop_token_ids=[ids[1]], min_tokens=2)
    d.add(ids[0])
    assert d.add(ids[1]).stopped is None                 # stop token, but only the 2nd token
    steps = stream(d, ids[2:])
    assert steps[-1].stopped == StopReason("stop_string", "re")
    assert d.text == "stop he"


def test_eos_ignored_before_min_tokens():
    d = detok(min_tokens=2)                              # two tokens must come before an eos
    assert d.add(EOS) == d.add(EOS) == DetokenizerStep("")
    assert d.add(EOS).stopped == StopReason("eos", EOS)


def test_adding_after_stop_is_an_error():
    d = detok(stop=["o"])
    assert stream(d, TOK.encode("no"))[-1].stopped is not None
    with pytest.raises(RuntimeError, match="already stopped"):
        d.add(TOK.encode("x")[0])
