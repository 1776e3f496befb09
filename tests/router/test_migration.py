"""RelayedStream, the router's view of a relayed stream (issue 11 migration): which tokens the
client has seen, the response id, and what another decode worker needs to continue exactly there."""
from __future__ import annotations

import json

from router.request.migration import RelayedStream, continuation_body


def chunk(delta: dict | None = None, ids=None, finish=None, cid="chatcmpl-a", text=None) -> bytes:
    choice = {"index": 0, "finish_reason": finish}
    if delta is not None:
        choice["delta"] = delta
    if text is not None:
        choice["text"] = text
    if ids is not None:
        choice["token_ids"] = ids
    return b"data: " + json.dumps({"id": cid, "created": 1, "choices": [choice]}).encode() + b"\n\n"


def events(out: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in out.decode().split("\n") if line.startswith("data: {")]


def test_tokens_are_recorded_and_stripped_and_split_events_wait():
    s = RelayedStream(keep_token_ids=False)
    first = chunk({"role": "assistant", "content": ""}, []) + chunk({"content": "Hel"}, [1, 2])
    half = chunk({"content": "lo"}, [3])
    out = s.feed(first + half[:10])
    assert [e["choices"][0].get("token_ids") for e in events(out)] == [None, None]
    assert s.token_ids == [1, 2]                       # the cut event is not delivered, so not counted
    out = s.feed(half[10:])
    assert events(out)[0]["choices"][0]["delta"]["content"] == "lo" and s.token_ids == [1, 2, 3]
    body = continuation_body({"messages": [], "stream": True, "kv_transfer_params": {"x": 1}, "seed": 3}, s, True)
    assert body["kimi_pd_resume"] == {"token_ids": [1, 2, 3], "seed_offset": 2, "response_id": "chatcmpl-a"}
    assert "kv_transfer_params" not in body and body["return_token_ids"] is True and body["seed"] == 3


def test_a_continuation_keeps_the_first_id_and_drops_its_role_chunk():
    s = RelayedStream(keep_token_ids=True)
    s.feed(chunk({"role": "assistant", "content": ""}, [], cid="chatcmpl-first") + chunk({"content": "a"}, [7]))
    s.restart()
    out = s.feed(chunk({"role": "assistant", "content": ""}, [], cid="chatcmpl-second")
                 + chunk({"content": "b"}, [8], cid="chatcmpl-second") + chunk({}, [], finish="length",
                                                                               cid="chatcmpl-second")
                 + b"data: [DONE]\n\n")
    got = events(out)
    assert [e["id"] for e in got] == ["chatcmpl-first"] * 2 and got[0]["choices"][0]["token_ids"] == [8]
    assert s.done and s.finished and not s.resumable and s.token_ids == [7, 8]


def test_content_without_token_ids_cannot_be_resumed():
    s = RelayedStream(keep_token_ids=False)
    s.feed(chunk(text="hello"))
    assert not s.resumable                             # a worker that ignores return_token_ids: no replay
    fresh = RelayedStream(keep_token_ids=False)
    fresh.feed(chunk({"role": "assistant", "content": ""}))
    assert fresh.resumable and "kimi_pd_resume" not in continuation_body({"stream": True}, fresh, False)


def test_error_events_pass_through_and_are_counted():
    s = RelayedStream(keep_token_ids=False)
    out = s.feed(b'event: error\ndata: {"error": {"message": "x", "type": "server_error"}}\n\ndata: [DONE]\n\n')
    assert s.errors == 1 and s.done and out.startswith(b"event: error\n")


def _state(s: RelayedStream) -> tuple:
    return s.token_ids, s.response_id, s.created, s.finished, s.done, s.errors, s.untracked


def test_one_event_per_chunk_is_relayed_as_a_stream_read_whole():
    """The one-event chunk's shortcut (no SSEEvent; forwarded as it came unless changed) gives the same
    events and the same view as the general parser reading the same stream in one piece."""
    stream = [chunk({"role": "assistant", "content": ""}, [], cid="c1"), chunk({"content": "a"}, [5], cid="c1"),
              chunk({"content": "b"}, cid="c1"), chunk({"content": "c"}, [6, 7], cid="c-other"),
              b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n',
              b"data: not json\n\n", b"data: [1, 2]\n\n",
              chunk({}, [8], finish="stop", cid="c1"), b"data: [DONE]\n\n"]
    for keep in (False, True):
        per_event, whole = RelayedStream(keep_token_ids=keep), RelayedStream(keep_token_ids=keep)
        pieces = [per_event.feed(c) for c in stream]
        assert events(b"".join(pieces)) == events(whole.feed(b"".join(stream)))
        assert _state(per_event) == _state(whole)
        assert pieces[2] == stream[2]                    # nothing to change: the upstream's bytes as they came
        assert events(pieces[3])[0]["id"] == "c1"        # re-named under the first response id
        assert ("token_ids" in events(pieces[1])[0]["choices"][0]) == keep
    assert per_event.errors == 1 and per_event.done and per_event.untracked
    calm = RelayedStream(keep_token_ids=False)
    plain = chunk({"role": "assistant", "content": ""}) + chunk({"content": "x"}) + b"data: [DONE]\n\n"
    assert calm.feed(plain) is plain and calm.done     # several events, none changed: the chunk itself
