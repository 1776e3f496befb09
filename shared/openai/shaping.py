"""K3 completion text (decoded with special tokens) -> an OpenAI assistant message, whole or streamed.

`shape_chat_message` applies the K3 parsers (`shared.prompt.parsers`) to a finished text.
`ChatDeltaShaper` turns the same text, arriving in pieces, into deltas whose concatenation equals
that message for every way of splitting the text. It walks the channels in order::

    think_prefix -> think -> response_start -> response -> between -> tools -> done
    (thinking off starts at response_start)

holding back only text that may still turn into a marker (or, at the start of the response
channel, whitespace that a following `<|open|>response<|sep|>` would swallow), so markers never
reach `content` and no delta is ever taken back. Each piece costs time proportional to its length.

An output cut at the length limit (`cut`) keeps what was held back: a fragment that never became a
marker is text, and a tools channel cut before its first complete call is given as `content` (its raw
markup), as vLLM gives a model output its tool parser cannot parse, rather than dropping it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from shared.openai.messages import FunctionCall, ToolCall
from shared.openai.responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from shared.prompt.parsers import (
    END_OF_MSG,
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    parse_tool_calls,
    split_reasoning,
)

_THINK_ENDS = (THINK_CLOSE, END_OF_MSG)
_CONTENT_ENDS = (RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE, END_OF_MSG)
_CONTENT_MARKERS = (RESPONSE_OPEN, *_CONTENT_ENDS)
_CALL_CLOSE = "<|close|>call<|sep|>"
_TOOLS_ENDS = (TOOLS_CLOSE, END_OF_MSG)
# How far back a marker can start that the newest piece completes.
_BETWEEN_KEEP = max(len(TOOLS_OPEN), len(END_OF_MSG)) - 1
_TOOLS_KEEP = max(len(m) for m in (_CALL_CLOSE, *_TOOLS_ENDS)) - 1


class ShapedMessage(NamedTuple):
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None           # "tool_calls" when calls were made, else None (keep the engine's)


def shape_chat_message(text: str, *, thinking: bool, tools_requested: bool,
                       strip: SpecialTokenStrip | None = None, cut: bool = False) -> ShapedMessage:
    """Split a finished K3 completion into reasoning, content and tool calls.

    Nothing after the first `<|end_of_msg|>` belongs to the message. `content` is None only when
    there are tool calls and no text, as in OpenAI's responses. `strip` (skip_special_tokens)
    removes special-token text from the reasoning and the content once the markers are parsed.
    `cut`: the output ended at the length limit (see the module doc); shaped as the stream is.
    """
    if cut:
        return _shape_cut(text, thinking=thinking, tools_requested=tools_requested, strip=strip)
    reasoning, content = split_reasoning(text, thinking=thinking)
    if strip is not None:
        reasoning, content = strip(reasoning), strip(content)
    calls: list[ToolCall] = []
    if tools_requested:
        end = text.find(END_OF_MSG)
        calls = [_tool_call(c) for c in parse_tool_calls(text if end < 0 else text[:end], thinking=thinking)]
    return ShapedMessage(
        content=None if calls and not content else content,
        reasoning_content=reasoning or None,
        tool_calls=calls,
        finish_reason="tool_calls" if calls else None,
    )


def _shape_cut(text: str, *, thinking: bool, tools_requested: bool, strip: SpecialTokenStrip | None) -> ShapedMessage:
    """A cut output, shaped by streaming it whole: one definition of what a cut keeps."""
    shaper = ChatDeltaShaper(thinking=thinking, tools_requested=tools_requested, strip=strip)
    deltas = [d for d in (shaper.feed(text), shaper.finish(cut=True)) if d is not None]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    calls = [ToolCall(id=c.id or "", function=FunctionCall(name=c.function.name or "", arguments=c.function.arguments
                                                            or "")) for d in deltas for c in d.tool_calls or []
             if c.function is not None]
    return ShapedMessage(content=None if calls and not content else content, reasoning_content=reasoning or None,
                         tool_calls=calls, finish_reason=shaper.finish_reason)


def _tool_call(call: dict[str, Any]) -> ToolCall:
    return ToolCall(id=call["id"], function=FunctionCall(**call["function"]))


def _held_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that a marker starts with (the parsers' hold-back)."""
    longest = max(len(m) for m in markers) - 1
    for n in range(min(len(text), longest), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _first(text: str, markers: tuple[str, ...]) -> int:
    return min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)


class SpecialTokenStrip:
    """Chat's `skip_special_tokens`: removes special tokens' names from parsed text.

    Chat output is decoded with its special tokens (the K3 markers the parsers read by name), so the
    strip runs on the reasoning and content channels once parsed, by name, as the parsers read them.
    """

    def __init__(self, names: Iterable[str]) -> None:
        names = sorted(set(names), key=len, reverse=True)     # longest first: no name eats a prefix
        self._re = re.compile("|".join(map(re.escape, names)))
        self._prefixes = {name[:i] for name in names for i in range(1, len(name))}
        self._longest = max(map(len, names)) - 1

    def __call__(self, text: str) -> str:
        return self._re.sub("", text)

    def held_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that starts a name (a streamed name may be split)."""
        for n in range(min(len(text), self._longest), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0


class ChatDeltaShaper:
    """Streams one assistant message: `feed` each new piece of text, then `finish` once."""

    def __init__(self, *, thinking: bool, tools_requested: bool, strip: SpecialTokenStrip | None = None) -> None:
        self._tools_requested = tools_requested
        self._strip = strip
        self._unstripped: dict[str, str] = {}     # per channel: a tail that may be the start of a name
        self._state = "think_prefix" if thinking else "response_start"
        self._buf = ""                  # text of the current channel not yet emitted
        self._tools_text = ""           # the tools channel so far
        self._calls_sent = 0
        self._out: dict[str, str] = {}
        self._new_calls: list[DeltaToolCall] = []
        self._cut = False               # finishing an output cut at the length limit

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" once a call has been emitted, else None (keep the engine's reason)."""
        return "tool_calls" if self._calls_sent else None

    def feed(self, text: str) -> DeltaMessage | None:
        """The delta for `text`, the next piece of the completion; None if there is nothing new yet."""
        self._buf += text
        return self._run(final=False)

    def finish(self, cut: bool = False) -> DeltaMessage | None:
        """What the finished text adds: text that was held back for a marker that never came (`cut`: the
        output ended at the length limit, so fragments and an unfinished tools channel are kept too)."""
        self._cut = cut
        return self._run(final=True)

    def _run(self, final: bool) -> DeltaMessage | None:
        while getattr(self, f"_state_{self._state}")(final):
            pass
        open_channel = {"think_prefix": "reasoning", "think": "reasoning", "response": "content"}.get(self._state)
        for channel in [c for c in self._unstripped if final or c != open_channel]:
            self._emit_stripped(channel, self._unstripped.pop(channel))   # its channel ended: no name follows
        delta = DeltaMessage(reasoning_content=self._out.get("reasoning") or None,
                             content=self._out.get("content") or None, tool_calls=self._new_calls or None)
        self._out, self._new_calls = {}, []
        return None if delta == DeltaMessage() else delta

    def _emit(self, channel: str, text: str) -> None:
        if self._strip is not None:
            text = self._unstripped.pop(channel, "") + text
            keep = len(text) - self._strip.held_len(text)
            text, self._unstripped[channel] = self._strip(text[:keep]), text[keep:]
        if text:
            self._out[channel] = self._out.get(channel, "") + text

    def _emit_stripped(self, channel: str, text: str) -> None:
        text = self._strip(text) if self._strip is not None else text
        if text:
            self._out[channel] = self._out.get(channel, "") + text

    def _goto(self, state: str, buf: str) -> bool:
        self._state, self._buf = state, buf
        return True

    # Each state consumes what it can; True means "state changed, run the next one".

    def _state_think_prefix(self, final: bool) -> bool:
        if self._buf.startswith(THINK_OPEN):  # the model echoed the prompt's opener
            return self._goto("think", self._buf[len(THINK_OPEN):])
        if THINK_OPEN.startswith(self._buf) and not final:
            return False
        return self._goto("think", self._buf)

    def _state_think(self, final: bool) -> bool:
        end = _first(self._buf, _THINK_ENDS)
        if end < 0:
            keep = len(self._buf) - (0 if final and self._cut else _held_len(self._buf, _THINK_ENDS))
            self._emit("reasoning", self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._emit("reasoning", self._buf[:end])
        if self._buf.startswith(END_OF_MSG, end):
            return self._goto("done", "")
        return self._goto("response_start", self._buf[end + len(THINK_CLOSE):])

    def _state_response_start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(RESPONSE_OPEN):
            return self._goto("response", stripped[len(RESPONSE_OPEN):])
        if RESPONSE_OPEN.startswith(stripped) and not final:
            return False  # whitespace and perhaps the start of the opener: wait
        return self._goto("response", self._buf)

    def _state_response(self, final: bool) -> bool:
        end = _first(self._buf, _CONTENT_ENDS)
        if end < 0:
            keep = len(self._buf) - (0 if final and self._cut else _held_len(self._buf, _CONTENT_MARKERS))
            self._emit("content", self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._emit("content", self._buf[:end])
        return self._goto("between" if self._tools_requested else "done", self._buf[end:])

    def _state_between(self, final: bool) -> bool:
        start, end = self._buf.find(TOOLS_OPEN), self._buf.find(END_OF_MSG)
        if end >= 0 and (start < 0 or end < start):
            return self._goto("done", "")
        if start >= 0:
            return self._goto("tools", self._buf[start + len(TOOLS_OPEN):])
        self._buf = self._buf[-_BETWEEN_KEEP:]
        return False

    def _state_tools(self, final: bool) -> bool:
        """Re-parses the channel only when a call closes, so each complete call is sent once."""
        scan_from = max(0, len(self._tools_text) - _TOOLS_KEEP)
        self._tools_text += self._buf
        self._buf = ""
        end = _first(self._tools_text[scan_from:], _TOOLS_ENDS)
        body = self._tools_text if end < 0 else self._tools_text[:scan_from + end]
        if _CALL_CLOSE in body[scan_from:]:
            self._send_calls(parse_tool_calls(TOOLS_OPEN + body, thinking=False))
        if final and self._cut and end < 0 and not self._calls_sent:
            pending = self._unstripped.pop("content", "")                      # cut before a complete call
            self._emit_stripped("content", pending + TOOLS_OPEN + self._tools_text)
        return self._goto("done", "") if end >= 0 else False

    def _send_calls(self, calls: list[dict[str, Any]]) -> None:
        for index in range(self._calls_sent, len(calls)):
            call = calls[index]
            self._new_calls.append(DeltaToolCall(
                index=index, id=call["id"], type="function",
                function=DeltaFunctionCall(name=call["function"]["name"], arguments=call["function"]["arguments"]),
            ))
        self._calls_sent = len(calls)

    def _state_done(self, final: bool) -> bool:
        self._buf = ""
        return False
