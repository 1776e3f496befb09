"""Server-sent events: framing for the OpenAI streams, and an incremental parser for relays.

A stream is `data: {chunk}` events then `data: [DONE]`. A stream that fails after it started sends
an `event: error` frame whose data is an OpenAI error body, then `[DONE]` (docs/http.md, Errors and headers), never a
silent end; the official OpenAI client raises an `APIError` on it. Stock vLLM instead sends
`data: {"error": ...}` (or, in older versions, `{"object": "error", ...}`); `SSEEvent.error`
recognises all three.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pydantic import BaseModel

from shared.openai.errors import error_response

SSE_DONE = b"data: [DONE]\n\n"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")             # the only line ends SSE knows
_LINE_END = re.compile(rb"\r\n|\r|\n")


def sse_event(data: BaseModel | Mapping[str, Any] | str, *, event: str | None = None) -> bytes:
    """One event: a model or mapping as compact JSON, a string as is (one `data:` line per line)."""
    if isinstance(data, BaseModel):
        text = data.model_dump_json()
    elif isinstance(data, Mapping):
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    else:
        text = data
    head = f"event: {event}\n" if event else ""
    return (head + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(text)) + "\n").encode()


def sse_error(status: int, message: str, type: str | None = None, code: str | int | None = None,
              param: str | None = None) -> bytes:
    """An `event: error` frame with an OpenAI error body; the stream should then send `SSE_DONE`."""
    return sse_event(error_response(status, message, type, code, param), event="error")


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"

    @property
    def is_error(self) -> bool:
        # the cheap test first, and no cached_property lock: a relay asks this of every token's event
        return (self.event == "error" or '"error"' in self.data) and self.error is not None

    @cached_property
    def error(self) -> dict[str, Any] | None:
        """The error object (`message`, `type`, `param`, `code`) if this event reports a failure."""
        if self.event != "error" and '"error"' not in self.data:
            return None  # cheap test first: a relay sees one event per token
        try:
            body = json.loads(self.data)
        except json.JSONDecodeError:
            return {"message": self.data, "type": "server_error"} if self.event == "error" else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body["error"]
        if isinstance(body, dict) and body.get("object") == "error":
            return {k: body.get(k) for k in ("message", "type", "param", "code")}
        return {"message": self.data, "type": "server_error"} if self.event == "error" else None

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class SSEParser:
    """Feed the bytes of a stream in chunks of any size; get each complete event once.

    Follows the SSE spec: lines end with CRLF, CR or LF (a CRLF may be split between chunks),
    `:` lines are comments, `data` lines of one event are joined with LF, an event without data is
    dropped, and a leading byte-order mark is ignored. Bytes are decoded per complete line, so a
    character split between chunks is never garbled.
    """

    _buf: bytearray = field(default_factory=bytearray)
    _data: list[str] = field(default_factory=list)
    _event: str | None = None
    _id: str | None = None
    _skip_lf: bool = False          # the last chunk ended in CR: a leading LF is its CRLF's half
    _at_start: bool = True

    @property
    def pending(self) -> bool:
        """True if the bytes so far end inside an event (a stream cut short)."""
        return bool(self._buf or self._data or self._event)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        whole = self._whole_data_events(chunk)
        if whole is not None:
            return whole
        if self._skip_lf and chunk:
            chunk = chunk[1:] if chunk[:1] == b"\n" else chunk
            self._skip_lf = False
        self._buf += chunk
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(self._buf):
            if match.group() == b"\r" and match.end() == len(self._buf):
                self._skip_lf = True
            event = self._line(bytes(self._buf[start:match.start()]).decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
            start = match.end()
        del self._buf[:start]
        return events

    def whole_data(self, chunk: bytes) -> list[bytes] | None:
        """The data bytes of each event when `chunk` is whole events of one `data: ` line each, LF
        line ends, and nothing is pending (what every OpenAI server sends, one event per token): a
        relay's common chunk, read in one scan without building events; the parser's state is then
        as after `feed`. None for anything else (comments, `event:`/`id:` fields, CR line ends, a
        partial event, a byte-order mark, bytes pending from an earlier chunk): `feed` it."""
        if (self._buf or self._data or self._event is not None or self._skip_lf
                or not chunk.endswith(b"\n\n") or b"\r" in chunk):
            return None
        pieces = chunk[:-2].split(b"\n\n")
        for piece in pieces:
            if not piece.startswith(b"data: ") or b"\n" in piece:
                return None
        self._at_start = False
        return [piece[6:] for piece in pieces]

    def _whole_data_events(self, chunk: bytes) -> list[SSEEvent] | None:
        """`whole_data` as events; on the chunks it accepts the line parser gives the same events."""
        data = self.whole_data(chunk)
        return None if data is None else [SSEEvent(d.decode("utf-8", errors="replace"), None, self._id) for d in data]

    def _line(self, line: str) -> SSEEvent | None:
        if self._at_start:
            line, self._at_start = line.removeprefix("\ufeff"), False
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], None
        return SSEEvent("\n".join(data), event or None, self._id) if data else None
