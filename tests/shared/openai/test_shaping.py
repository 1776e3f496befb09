"""K3 output text -> OpenAI assistant message: whole, and streamed at every possible split."""
from __future__ import annotations

import json
import random

import pytest

from shared.openai.convert import ChatDeltaShaper, shape_chat_message
from shared.openai.shaping import SpecialTokenStrip
from shared.prompt.tokenizer import KimiTokenizer

STRIP = SpecialTokenStrip(KimiTokenizer.generated().special_tokens)

CALLS = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
         '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
         '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
         '<|open|>call tool="get_time" index="2"<|sep|><|open|>json type="object"<|sep|>{"tz": "CET"}'
         '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
THINK_END, RESPONSE, RESPONSE_END = "<|close|>think<|sep|>", "<|open|>response<|sep|>", "<|close|>response<|sep|>"
MESSAGE_END = "<|close|>message<|sep|>"
K3_OUTPUTS = [
    f"Let me think.\nIt is 2+2.{THINK_END}{RESPONSE}The answer is 4. ✓{RESPONSE_END}{MESSAGE_END}",
    f"Need weather.{THINK_END}{RESPONSE}{RESPONSE_END}{CALLS}{MESSAGE_END}",
    f"Plan: call.{THINK_END}{RESPONSE}Checking… 🌦{RESPONSE_END}{CALLS}{MESSAGE_END}<|end_of_msg|>",
    f"r{THINK_END}\n {RESPONSE}Hi",                        # whitespace before the opener is dropped
    f"r{THINK_END}\n Hi there{RESPONSE_END}",               # ... but is content without an opener
    f"r{THINK_END}  {RESPONSE_END}{MESSAGE_END}",
    f"r{THINK_END}Hi {RESPONSE}x",                          # an opener after text is text
    f"<|open|>think<|sep|>echoed opener{THINK_END}{RESPONSE}ok",
    "<|open|>th", "Thinking about <|clo", "abc<|end_of_msg|>junk", "", THINK_END,
    f"a < b and <|weird|> text{THINK_END}{RESPONSE}x <| y <|close|>resp",
    # the cut-short first call is dropped
    (f"t{THINK_END}{RESPONSE}c{RESPONSE_END}<|open|>tools<|sep|><|open|>call tool=\"a\" index=\"1\"<|sep|>"
     f"<|open|>call tool=\"b&amp;c\" index=\"2\"<|sep|><|close|>call<|sep|>"),
    f"t{THINK_END}{RESPONSE}c{RESPONSE_END}{CALLS[:180]}<|end_of_msg|>{CALLS}",
    f"Hello{RESPONSE_END}{CALLS}{MESSAGE_END}",             # as generated with thinking off
    f"  {RESPONSE}Hi{RESPONSE_END}",
    f"t{THINK_END}{RESPONSE}c{RESPONSE_END}{CALLS}after the tools",
    f"t{THINK_END}{RESPONSE}cut inside an opener <|open|>resp",  # held back like a marker, as the parser does
]
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def summary(content, reasoning, calls, finish) -> tuple:
    return content or "", reasoning or "", calls, finish


def whole(text: str, thinking: bool, tools: bool, strip: SpecialTokenStrip | None = None) -> tuple:
    shaped = shape_chat_message(text, thinking=thinking, tools_requested=tools, strip=strip)
    calls = [(c.id, c.function.name, c.function.arguments) for c in shaped.tool_calls]
    return summary(shaped.content, shaped.reasoning_content, calls, shaped.finish_reason)


def streamed(pieces: list[str], thinking: bool, tools: bool, strip: SpecialTokenStrip | None = None) -> tuple:
    shaper = ChatDeltaShaper(thinking=thinking, tools_requested=tools, strip=strip)
    deltas = [d for d in [*(shaper.feed(p) for p in pieces), shaper.finish()] if d is not None]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.index for tc in calls] == list(range(len(calls)))
    flat = [(tc.id, tc.function.name, tc.function.arguments) for tc in calls]
    return summary("".join(d.content or "" for d in deltas), "".join(d.reasoning_content or "" for d in deltas),
                   flat, shaper.finish_reason)


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """Every two-piece split, one character at a time, and random multi-piece splits."""
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(2, 12))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=False)])
    return ways


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize("text", K3_OUTPUTS)
def test_streaming_equals_whole_at_every_split(text, thinking, tools):
    expected = whole(text, thinking, tools)
    for pieces in splits(text, random.Random(len(text))):
        assert streamed(pieces, thinking, tools) == expected, pieces


# Special tokens a model may emit inside its channels (the reserved ones, media, [EOS]) beside text
# that only looks like one (`[EO`, `<|open`), for chat's skip_special_tokens.
WITH_SPECIALS = [
    f"plan [EOS]a<|reserved_token_8|>{THINK_END}{RESPONSE}Hi<|media_pad|> [EO x<|open{RESPONSE_END}",
    f"<|reserved_token_10|>{THINK_END}{RESPONSE}<|open|><|sep|>[BOS]ok [",
    f"r[EOT]{THINK_END}{RESPONSE}tail [start_header_id",
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("text", WITH_SPECIALS)
def test_skip_special_tokens_strips_names_whole_and_streamed_at_every_split(text, thinking):
    expected = whole(text, thinking, False, STRIP)
    kept = whole(text, thinking, False)
    assert expected[:2] == (STRIP(kept[0]), STRIP(kept[1]))
    assert kept != expected                                   # the case has names to strip
    for pieces in splits(text, random.Random(len(text))):
        assert streamed(pieces, thinking, False, STRIP) == expected, pieces


def test_skip_special_tokens_keeps_text_that_only_looks_like_a_name():
    content = whole(WITH_SPECIALS[0], True, False, STRIP)[0]
    assert content == "Hi [EO x<|open"
    assert whole(WITH_SPECIALS[0], True, False, STRIP)[1] == "plan a"
    assert whole(WITH_SPECIALS[2], True, False, STRIP)[0] == "tail [start_header_id"


def test_shape_well_formed_message_with_tool_calls():
    shaped = shape_chat_message(K3_OUTPUTS[2], thinking=True, tools_requested=True)
    assert (shaped.reasoning_content, shaped.content) == ("Plan: call.", "Checking… 🌦")
    assert shaped.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in shaped.tool_calls] == [
        ("get_weather:0", "get_weather", {"city": "Paris", "days": 3}), ("get_time:1", "get_time", {"tz": "CET"})]
    only_calls = shape_chat_message(K3_OUTPUTS[1], thinking=True, tools_requested=True)
    assert only_calls.content is None and len(only_calls.tool_calls) == 2
    ignored = shape_chat_message(K3_OUTPUTS[1], thinking=True, tools_requested=False)
    assert (ignored.content, ignored.tool_calls, ignored.finish_reason) == ("", [], None)


def test_shape_thinking_off_and_truncated_output():
    off = shape_chat_message(f"Hello{RESPONSE_END}{MESSAGE_END}", thinking=False, tools_requested=False)
    assert (off.content, off.reasoning_content) == ("Hello", None)
    cut = shape_chat_message(f"Because{THINK_END}{RESPONSE}Hel<|clo", thinking=True, tools_requested=False)
    assert (cut.reasoning_content, cut.content) == ("Because", "Hel")


@pytest.mark.parametrize("text", K3_OUTPUTS[:3])
def test_markers_never_reach_streamed_content(text):
    shaper = ChatDeltaShaper(thinking=True, tools_requested=True)
    for piece in [*text, None]:
        delta = shaper.feed(piece) if piece is not None else shaper.finish()
        for value in (delta.content, delta.reasoning_content) if delta else ():
            assert value is None or not any(marker in value for marker in MARKERS) and "<|" not in value


def streamed_cut(pieces: list[str], thinking: bool, tools: bool, strip: SpecialTokenStrip | None = None) -> tuple:
    shaper = ChatDeltaShaper(thinking=thinking, tools_requested=tools, strip=strip)
    deltas = [d for d in [*(shaper.feed(p) for p in pieces), shaper.finish(cut=True)] if d is not None]
    flat = [(tc.id, tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []]
    return summary("".join(d.content or "" for d in deltas), "".join(d.reasoning_content or "" for d in deltas),
                   flat, shaper.finish_reason)


def whole_cut(text: str, thinking: bool, tools: bool, strip: SpecialTokenStrip | None = None) -> tuple:
    shaped = shape_chat_message(text, thinking=thinking, tools_requested=tools, strip=strip, cut=True)
    calls = [(c.id, c.function.name, c.function.arguments) for c in shaped.tool_calls]
    return summary(shaped.content, shaped.reasoning_content, calls, shaped.finish_reason)


@pytest.mark.parametrize("strip", [None, STRIP])
@pytest.mark.parametrize("text", K3_OUTPUTS + WITH_SPECIALS)
def test_a_cut_output_streams_as_it_shapes_whole_at_every_split(text, strip):
    expected = whole_cut(text, True, True, strip)
    for pieces in splits(text, random.Random(len(text)))[::3]:
        assert streamed_cut(pieces, True, True, strip) == expected, pieces


def test_at_the_length_limit_held_back_text_and_unfinished_tool_markup_are_kept():
    cut_marker = f"Because{THINK_END}{RESPONSE}Hel<|clo"
    assert whole_cut(cut_marker, True, False)[:2] == ("Hel<|clo", "Because")      # not a marker after all
    assert whole(cut_marker, True, False)[:2] == ("Hel", "Because")                # a natural end drops it
    call = f't{THINK_END}{RESPONSE}Sure.{RESPONSE_END}<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"'
    content, reasoning, calls, finish = whole_cut(call, True, True)
    assert (reasoning, calls, finish) == ("t", [], None)
    assert content == 'Sure.<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"'
    assert whole_cut(call, True, True, STRIP)[0] == 'Sure.toolscall tool="get_weather" index="1"'
    assert whole(call, True, True)[0] == "Sure."                                    # before: dropped
    first_call = CALLS.index("<|close|>call<|sep|>") + 30
    complete = f"t{THINK_END}{RESPONSE}{RESPONSE_END}{CALLS[:first_call]}"          # a complete call, then cut
    assert whole_cut(complete, True, True)[2] == whole(complete, True, True)[2] != []
    assert whole_cut("reasoning cut <|close|>thi", True, True)[1] == "reasoning cut <|close|>thi"
