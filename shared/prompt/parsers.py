"""Output parsers for generated K3 XTML text: reasoning/content split and OpenAI tool calls.

Input is the completion decoded with `skip_special_tokens=False`, starting right after the
generation prompt, i.e. inside the `think` channel (thinking on) or the `response` channel (off)::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>TEXT<|close|>response<|sep|>
    [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>...<|close|>call<|sep|><|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>

Both functions are pure and tolerate an unfinished stream: they return what is complete, hold back
a trailing fragment that may still grow into a marker, and drop a tool call whose
`<|close|>call<|sep|>` has not arrived. Like the vLLM-Ascend K3 parsers they are lenient on a
finished but malformed output (a non-JSON typed value stays a string) rather than raising.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import regex

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"

_CONTENT_ENDS = (RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE, END_OF_MSG)
_ATTR_RE = regex.compile(r'\s*([A-Za-z_][\w.:-]*)="([^"]*)"')


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str


def split_reasoning(text: str, *, thinking: bool = True) -> ReasoningSplit:
    """Split a completion into the think channel's text and the response channel's text.

    The tools channel is not content (see `parse_tool_calls`). With thinking off there is no think
    channel: everything up to the end of the response is content.
    """
    if not thinking:
        return ReasoningSplit("", _response_text(text))
    body = text.removeprefix(THINK_OPEN)  # tolerate the model echoing the prompt's opener
    close, end = body.find(THINK_CLOSE), body.find(END_OF_MSG)
    if close < 0 or 0 <= end < close:
        reasoning = body[:end] if end >= 0 else _hold_back(body, (THINK_CLOSE, END_OF_MSG))
        return ReasoningSplit(reasoning, "")
    return ReasoningSplit(body[:close], _response_text(body[close + len(THINK_CLOSE):]))


def _response_text(text: str) -> str:
    """Body of the response channel; its opener is optional (thinking off opens it in the prompt)."""
    start = text.find(RESPONSE_OPEN)
    if start >= 0 and not text[:start].strip():
        text = text[start + len(RESPONSE_OPEN):]
    ends = [i for i in (text.find(marker) for marker in _CONTENT_ENDS) if i >= 0]
    return text[:min(ends)] if ends else _hold_back(text, (RESPONSE_OPEN, *_CONTENT_ENDS))


def _hold_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a trailing fragment that could still grow into one of `markers`."""
    longest = max(len(marker) for marker in markers) - 1
    for n in range(min(len(text), longest), 0, -1):
        if any(marker.startswith(text[-n:]) for marker in markers):
            return text[:-n]
    return text


def parse_tool_calls(text: str, *, thinking: bool = True) -> list[dict[str, Any]]:
    """Complete calls of the `tools` channel as OpenAI `tool_calls`.

    Each is `{"id": "NAME:i", "type": "function", "function": {"name", "arguments"}}` with `i` the
    0-based call position (vLLM-Ascend's id scheme) and `arguments` a compact JSON object string.
    """
    if thinking:
        close = text.find(THINK_CLOSE)
        if close < 0:
            return []  # still reasoning: a tools marker here would be quoted text, not a call
        text = text[close + len(THINK_CLOSE):]
    start = text.find(TOOLS_OPEN)
    if start < 0:
        return []
    body = text[start + len(TOOLS_OPEN):]
    end = body.find(TOOLS_CLOSE)
    calls: list[dict[str, Any]] = []
    for attrs, call_body in _complete_blocks(body if end < 0 else body[:end], "call"):
        name = _parse_attrs(attrs).get("tool")
        if name:
            calls.append({
                "id": f"{name}:{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": _arguments_json(call_body)},
            })
    return calls


def _complete_blocks(text: str, tag: str) -> Iterator[tuple[str, str]]:
    """(attributes, body) of each closed `<|open|>TAG ...<|sep|>body<|close|>TAG<|sep|>`, in order.

    A linear scan, not a regex: an opener without its own close before the next opener was cut
    short and is skipped, so it cannot swallow the next block's body.
    """
    opener, closer = f"{OPEN}{tag}", f"{CLOSE}{tag}{SEP}"
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        header_end = text.find(SEP, start + len(opener))
        if header_end < 0:
            return
        body_start = header_end + len(SEP)
        close = text.find(closer, body_start)
        if close < 0:
            return
        next_open = text.find(opener, body_start)
        if 0 <= next_open < close:
            pos = next_open
            continue
        yield text[start + len(opener):header_end], text[body_start:close]
        pos = close + len(closer)


def _parse_attrs(text: str) -> dict[str, str]:
    """`key="value"` pairs; values unescaped `&quot;` before `&amp;` (the reverse of encoding)."""
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTR_RE.findall(text)}


def _arguments_json(body: str) -> str:
    """A call body (typed `argument` blocks, or one raw `json` block) as a JSON object string."""
    stripped = body.strip()
    if stripped.startswith(f"{OPEN}json"):
        raw = next((raw for _, raw in _complete_blocks(stripped, "json")), "")
        try:
            return _compact(json.loads(raw))
        except json.JSONDecodeError:
            return raw  # the model's own text, passed through as OpenAI does for bad arguments
    arguments: dict[str, Any] = {}
    for attrs, raw in _complete_blocks(body, "argument"):
        parsed = _parse_attrs(attrs)
        if "key" in parsed:
            arguments[parsed["key"]] = _typed_value(raw, parsed.get("type", "string"))
    return _compact(arguments)


def _typed_value(raw: str, value_type: str) -> Any:
    """`string` values are raw text; other types are JSON (kept as text if they do not parse)."""
    if value_type == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
