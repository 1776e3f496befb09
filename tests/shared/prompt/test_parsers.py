"""Reasoning split and tool-call parsing of generated K3 XTML text."""
from __future__ import annotations

import json
from typing import Any

import pytest

from shared.prompt.chat import render_chat
from shared.prompt.parsers import ReasoningSplit, parse_tool_calls, split_reasoning
from shared.prompt.tokenizer import KimiTokenizer

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
END = f"{CLOSE}message{SEP}{EOM}"


def response(text: str) -> str:
    return f"{OPEN}response{SEP}{text}{CLOSE}response{SEP}"


def think_done(text: str) -> str:
    """A completion starts inside the think channel opened by the generation prompt."""
    return f"{text}{CLOSE}think{SEP}"


def call(name: str, index: int, *arguments: str) -> str:
    return f'{OPEN}call tool="{name}" index="{index}"{SEP}{"".join(arguments)}{CLOSE}call{SEP}'


def arg(key: str, type_: str, value: str) -> str:
    return f'{OPEN}argument key="{key}" type="{type_}"{SEP}{value}{CLOSE}argument{SEP}'


def tools(*calls: str) -> str:
    return f"{OPEN}tools{SEP}{''.join(calls)}{CLOSE}tools{SEP}"


# ---- split_reasoning ------------------------------------------------------------------------------


def test_split_full_completion() -> None:
    text = think_done("Let me think.\n") + response("The answer is 4.") + END
    assert split_reasoning(text) == ReasoningSplit("Let me think.\n", "The answer is 4.")


def test_split_excludes_the_tools_channel_from_content() -> None:
    text = think_done("r") + response("Calling.") + tools(call("f", 1)) + END
    assert split_reasoning(text) == ("r", "Calling.")
    assert split_reasoning(think_done("r") + tools(call("f", 1)) + END) == ("r", "")


def test_split_tolerates_an_echoed_think_opener() -> None:
    text = f"{OPEN}think{SEP}" + think_done("r") + response("c") + END
    assert split_reasoning(text) == ("r", "c")


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        ("Still thinking", ("Still thinking", "")),
        ("Still thinking<|close|>", ("Still thinking", "")),  # may grow into <|close|>think<|sep|>
        (f"Still thinking{CLOSE}thi", ("Still thinking", "")),
        ("a < b", ("a < b", "")),
        (think_done("r"), ("r", "")),
        (think_done("r") + f"{OPEN}resp", ("r", "")),
        (think_done("r") + f"{OPEN}response{SEP}Partial ans", ("r", "Partial ans")),
        (think_done("r") + f"{OPEN}response{SEP}Partial ans{CLOSE}", ("r", "Partial ans")),
        (think_done("r") + response("done") + f"{CLOSE}mess", ("r", "done")),
    ],
)
def test_split_unfinished_stream(stream: str, expected: tuple[str, str]) -> None:
    assert split_reasoning(stream) == expected


def test_split_holds_back_a_fragment_that_may_become_a_marker() -> None:
    assert split_reasoning("x <") == ("x ", "")
    assert split_reasoning("x <|") == ("x ", "")
    assert split_reasoning("x <a") == ("x <a", "")


def test_split_stops_at_end_of_message_without_think_close() -> None:
    assert split_reasoning(f"only reasoning{EOM}trailing") == ("only reasoning", "")


def test_split_thinking_off() -> None:
    assert split_reasoning("Plain answer" + f"{CLOSE}response{SEP}" + END, thinking=False) == ("", "Plain answer")
    assert split_reasoning(response("wrapped") + END, thinking=False) == ("", "wrapped")
    assert split_reasoning("Partial", thinking=False) == ("", "Partial")


# ---- parse_tool_calls -----------------------------------------------------------------------------


def test_parse_typed_arguments() -> None:
    text = think_done("r") + response("") + tools(call(
        "get_weather", 1,
        arg("city", "string", "Paris, \"FR\""),
        arg("days", "number", "3"),
        arg("celsius", "boolean", "true"),
        arg("hint", "null", "null"),
        arg("opts", "object", '{"a": [1, "x"]}'),
        arg("tags", "array", '["a", "b"]'),
        arg("code", "string", "print(1)\n  {not json}"),
    )) + END
    (tool_call,) = parse_tool_calls(text)
    assert tool_call["id"] == "get_weather:0" and tool_call["type"] == "function"
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {
        "city": 'Paris, "FR"', "days": 3, "celsius": True, "hint": None, "opts": {"a": [1, "x"]},
        "tags": ["a", "b"], "code": "print(1)\n  {not json}",
    }


def test_parse_several_calls_json_block_and_escaped_attributes() -> None:
    json_call = f'{OPEN}json type="object"{SEP}{{"q": "x"}}{CLOSE}json{SEP}'
    text = think_done("r") + response("ok") + tools(
        call("search", 1, json_call),
        call("a&quot;b&amp;c", 2, arg("k&amp;", "string", "v"), arg("&amp;quot;", "string", "w")),
        call("now", 3),
    ) + END
    calls = parse_tool_calls(text)
    assert [c["id"] for c in calls] == ["search:0", 'a"b&c:1', "now:2"]
    assert [c["function"]["name"] for c in calls] == ["search", 'a"b&c', "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"q": "x"}, {"k&": "v", "&quot;": "w"}, {}]


def test_parse_malformed_values_are_tolerated() -> None:
    bad_json = f'{OPEN}json type="object"{SEP}{{oops{CLOSE}json{SEP}'
    text = think_done("") + tools(call("f", 1, arg("n", "number", "three")), call("g", 2, bad_json)) + END
    f, g = parse_tool_calls(text)
    assert json.loads(f["function"]["arguments"]) == {"n": "three"}
    assert g["function"]["arguments"] == "{oops"


@pytest.mark.parametrize("cut", [10, 40, 80, 120, 160])
def test_parse_unfinished_stream_returns_complete_calls_only(cut: int) -> None:
    first = call("f", 1, arg("a", "string", "x"))
    second = call("g", 2, arg("b", "number", "12345"), arg("c", "string", "long value " * 5))
    prefix = think_done("r") + response("") + f"{OPEN}tools{SEP}" + first
    stream = prefix + second[:cut]
    assert [c["function"]["name"] for c in parse_tool_calls(stream)] == ["f"]
    assert [c["function"]["name"] for c in parse_tool_calls(prefix + second)] == ["f", "g"]


def test_parse_skips_a_call_cut_short_by_the_next_one() -> None:
    truncated = f'{OPEN}call tool="f" index="1"{SEP}' + arg("a", "string", "x")[:20]
    text = think_done("") + tools(truncated + call("g", 2, arg("b", "string", "y"))) + END
    (only,) = parse_tool_calls(text)
    assert only["function"]["name"] == "g" and json.loads(only["function"]["arguments"]) == {"b": "y"}


def test_parse_without_tools() -> None:
    assert parse_tool_calls(think_done("r") + response("hi") + END) == []
    assert parse_tool_calls("") == []


def test_parse_ignores_tools_text_while_still_reasoning() -> None:
    assert parse_tool_calls("I could emit " + tools(call("f", 1))) == []
    thinking_off = parse_tool_calls(response("") + tools(call("f", 1)), thinking=False)
    assert [c["function"]["name"] for c in thinking_off] == ["f"]


# ---- agreement with the renderer ------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [True, False])
def test_parsers_invert_the_rendered_assistant_turn(thinking: bool) -> None:
    tok = KimiTokenizer.generated()
    arguments: dict[str, Any] = {"path": "/tmp/a b.txt", "mode": 420, "force": False, "extra": {"x": [1, None]}}
    assistant = {
        "role": "assistant", "reasoning_content": "Need the file.", "content": "Reading it.",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read", "arguments": json.dumps(arguments)}},
            {"id": "d", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        ],
    }
    user = {"role": "user", "content": "Open it"}
    prompt = render_chat(tok, [user], thinking=thinking).token_ids
    full = render_chat(tok, [user, assistant], thinking=thinking, add_generation_prompt=False).token_ids
    completion = tok.decode(full[len(prompt):])
    assert split_reasoning(completion, thinking=thinking) == ("Need the file." if thinking else "", "Reading it.")
    calls = parse_tool_calls(completion, thinking=thinking)
    assert [c["function"]["name"] for c in calls] == ["read", "ls"]
    assert json.loads(calls[0]["function"]["arguments"]) == arguments
    assert calls[1]["function"]["arguments"] == "{}"
