"""SSE framing, and the incremental parser across arbitrary byte splits."""
from __future__ import annotations

import json
import random

import pytest

from shared.openai.models import ChatCompletionChunk, ChatCompletionChunkChoice, DeltaMessage
from shared.openai.sse import SSE_DONE, SSEEvent, SSEParser, sse_error, sse_event


def chunk(content: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=1, model="kimi-k3",
                               choices=[ChatCompletionChunkChoice(delta=DeltaMessage(content=content))])


def parse_all(data: bytes, cuts: list[int] | None = None) -> list[SSEEvent]:
    parser, events, start = SSEParser(), [], 0
    for end in [*(cuts or []), len(data)]:
        events += parser.feed(data[start:end])
        start = end
    assert not parser.pending
    return events


def test_sse_event_frames():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse_event("[DONE]") == SSE_DONE
    multi_line = b"event: note\ndata: line 1\ndata: line 2\ndata: line 3\n\n"
    assert sse_event("line 1\nline 2\r\nline 3", event="note") == multi_line
    framed = sse_event(chunk("hi"))
    assert framed.startswith(b"data: {") and framed.endswith(b"}\n\n") and b"\n" not in framed[:-2]


def test_error_frame_then_done():
    stream = sse_event(chunk("par")) + sse_error(503, "decode worker lost", code="kv_transfer_failed") + SSE_DONE
    events = parse_all(stream)
    assert [e.event for e in events] == [None, "error", None]
    assert events[1].error == {"message": "decode worker lost", "type": "service_unavailable", "param": None,
                               "code": "kv_transfer_failed"}
    assert not events[0].is_error and events[1].is_error and events[2].is_done


# A worker stream as the router sees it: multi-byte text, a keep-alive comment, an error, [DONE].
STREAM = b"".join([
    b": keep-alive\n\n",
    sse_event(chunk("")), sse_event(chunk("Grüße, 世界 🌍")), sse_event(chunk("a\u2028b \"error\"")),
    b"id: 7\nretry: 100\ndata: {\"x\": 1}\n\n",
    sse_error(500, "boom"), SSE_DONE,
])
EXPECTED = [SSEEvent(sse_event(chunk(t))[6:-2].decode()) for t in ("", "Grüße, 世界 🌍", "a\u2028b \"error\"")]


def test_whole_stream():
    events = parse_all(STREAM)
    assert events[:3] == EXPECTED
    assert [ChatCompletionChunk.model_validate(e.json()).choices[0].delta.content for e in events[:3]] == [
        "", "Grüße, 世界 🌍", "a\u2028b \"error\""]
    assert (events[3].data, events[3].id) == ('{"x": 1}', "7")
    assert [e.is_error for e in events] == [False, False, False, False, True, False]
    assert events[-1].is_done and len(events) == 6


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_and_random_splits_give_the_same_events(line_end):
    data = STREAM.replace(b"\n", line_end)
    expected = parse_all(data)
    assert len(expected) == 6
    for cut in range(len(data) + 1):
        assert parse_all(data, [cut]) == expected, cut
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(1, 40)))
        assert parse_all(data, cuts) == expected, cuts
    assert parse_all(data, list(range(1, len(data)))) == expected  # one byte at a time


def test_crlf_split_between_chunks_is_one_line_end():
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r\n") == []   # the LF completes the CRLF; it is not a blank line
    assert parser.feed(b"\r\n") == [SSEEvent("a\nb")]


def test_spec_details():
    assert parse_all(b"\xef\xbb\xbfdata: bom\n\n") == [SSEEvent("bom")]
    assert parse_all(b"event: ping\n\ndata\n\ndata:no-space\n\n") == [SSEEvent(""), SSEEvent("no-space")]
    assert parse_all(b"data:  two spaces\n\n") == [SSEEvent(" two spaces")]


def test_pending_reports_a_stream_cut_inside_an_event():
    parser = SSEParser()
    parser.feed(b"data: {\"partial\": ")
    assert parser.pending
    parser.feed(b"1}\n")
    assert parser.pending            # a data line without its blank line
    assert parser.feed(b"\n") == [SSEEvent('{"partial": 1}')] and not parser.pending


@pytest.mark.parametrize("data, event, error", [
    (json.dumps({"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}), None,
     {"message": "m", "type": "BadRequestError", "param": None, "code": 400}),          # vLLM today
    (json.dumps({"object": "error", "message": "m", "type": "t", "param": None, "code": 500}), None,
     {"message": "m", "type": "t", "param": None, "code": 500}),                         # older vLLM
    ("worker crashed", "error", {"message": "worker crashed", "type": "server_error"}),
    (json.dumps({"choices": [{"delta": {"content": "error"}}]}), None, None),
    (json.dumps({"choices": [], "error": None}), None, None),
    ("[DONE]", None, None),
])
def test_error_recognition(data, event, error):
    assert SSEEvent(data, event).error == error
