"""StreamWatch finds [DONE] and error frames as the SSE parser would, however the bytes are split."""
from __future__ import annotations

import pytest

from router.stream_watch import StreamWatch
from shared.openai.sse import SSE_DONE, SSEParser, sse_error

CHUNK = b'data: {"choices": [{"delta": {"content": "data: [DONE] and event: error"}}]}\n\n'
STREAMS = [
    CHUNK * 3 + SSE_DONE,
    CHUNK + sse_error(502, "boom", "upstream_error", "decode_failed") + SSE_DONE,
    CHUNK * 2,                                                    # cut before [DONE]
    sse_error(500, "a", "x", "y") + sse_error(500, "b", "x", "y"),
    b"",
]


def parsed(stream: bytes) -> tuple[bool, int]:
    events = SSEParser().feed(stream)
    return any(e.is_done for e in events), sum(e.is_error for e in events)


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("size", [1, 2, 5, 13, 64, 10_000])
def test_watch_agrees_with_the_parser_for_any_split(stream, size):
    watch = StreamWatch()
    for i in range(0, len(stream), size):
        watch.feed(stream[i:i + size])
    assert (watch.done, watch.errors) == parsed(stream)
