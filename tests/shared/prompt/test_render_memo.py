"""A render through the piece memo gives exactly the ids of a render without it, cold and warm,
and the memo stays bounded."""
from __future__ import annotations

import copy

import pytest

from shared.prompt.chat import render_chat
from shared.prompt.render_memo import SHORT_CHARS, RenderMemo
from shared.prompt.tokenizer import KimiTokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "a" * SHORT_CHARS},
     {"role": "assistant", "content": "b" * (SHORT_CHARS + 1), "reasoning_content": "thought"},
     {"role": "developer", "name": "ops", "content": "x"},
     {"role": "user", "content": [{"type": "text", "text": "y"}]}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "rain"}, {"role": "user", "content": "and tomorrow?"}],
    # memoised tags: escaped and long attribute values, two results sent out of call order
    [{"role": "user", "name": 'o"k&1', "content": "x"},
     {"role": "user", "name": "n" * (SHORT_CHARS + 5), "content": "y"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
     {"role": "tool", "tool_call_id": "c2", "content": "sun"},
     {"role": "tool", "tool_call_id": "c1", "content": "rain"}],
]
OPTIONS = [{}, {"thinking": False}, {"thinking_effort": "low"}, {"tools": TOOLS}, {"tools": TOOLS, "thinking": False},
           {"keep_reasoning": False}, {"add_generation_prompt": False}]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_memoised_render_equals_a_plain_render_cold_and_warm(messages, options) -> None:
    plain = KimiTokenizer.generated()
    reference = copy.copy(plain)
    reference.render_memo = None                      # the renderer then encodes every piece itself
    memoised = copy.copy(plain)
    memoised.render_memo = RenderMemo()
    expected = render_chat(reference, messages, **options)
    for _ in range(3):                                # cold, then from the memo
        got = render_chat(memoised, messages, **options)
        assert got.token_ids == expected.token_ids and got.image_spans == expected.image_spans
    assert len(memoised.render_memo) > 0


def test_keyed_pieces_differ_by_everything_they_render() -> None:
    tok = copy.copy(KimiTokenizer.generated())
    tok.render_memo = RenderMemo()
    reference = copy.copy(tok)
    reference.render_memo = None
    messages = [{"role": "user", "content": "hi"}]
    for options in ({"thinking_effort": "low"}, {"thinking_effort": "high"}, {"thinking": False}, {"tools": TOOLS},
                    {"tools": TOOLS[:0]}, {}):
        assert render_chat(tok, messages, **options).token_ids == render_chat(reference, messages, **options).token_ids


def test_the_memo_is_bounded() -> None:
    memo = RenderMemo(max_units=800, max_short=4)
    encode = KimiTokenizer.generated().encode
    for i in range(10):
        assert memo.encode_short(f"w{i}", encode) == tuple(encode(f"w{i}"))
        memo.put(("k", i), list(range(90)), 5)
    assert len(memo._short) <= 4 and memo._units <= 800
    memo.put(("big",), list(range(200)), 0)           # over an eighth of the bound: not kept
    assert memo.get(("big",)) is None and memo.get(("k", 9)) == tuple(range(90))
