"""What the router needs to know about a relayed SSE stream, without parsing it: whether the
`data: [DONE]` frame came and how many `event: error` frames passed.

The relay forwards bytes as they arrive; parsing every frame of every stream into events only to
look for two markers cost more CPU than the forwarding. A marker counts only at the start of a
line (a JSON payload cannot hold a raw newline, so text that merely contains the words never
matches), and a marker split across two chunks is still seen once.
"""
from __future__ import annotations

DONE = b"\ndata: [DONE]"
ERROR = b"\nevent: error"
_KEEP = max(len(DONE), len(ERROR)) - 1       # bytes of the previous chunk a split marker can start in


class StreamWatch:
    __slots__ = ("done", "errors", "_tail")

    def __init__(self) -> None:
        self.done, self.errors, self._tail = False, 0, b"\n"     # the stream starts at a line start

    def feed(self, chunk: bytes) -> None:
        buf = self._tail + chunk
        if not self.done and DONE in buf:
            self.done = True
        self.errors += buf.count(ERROR)          # a whole marker never fits in the kept tail: no double count
        self._tail = buf[-_KEEP:]
