"""The benchmark stub worker speaks the P/D protocol the router expects.

Leg bodies come from the router's own builders (shared.openai.legs); replies are checked with the
router's SSE parser and error parsing and the project's OpenAI response models.
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import pytest

from router.transport.upstream import error_body
from shared.kv_transfer_params import KVTransferParams
from shared.openai.legs import decode_body, prefill_body, wire_body
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.responses import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk
from shared.openai.sse import SSEEvent, SSEParser
from tests.stub_worker import StubSettings, create_app, token_text

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx.*starlette.testclient")   # httpx is this project's client
    from fastapi.testclient import TestClient

TOKENS, PORT = 5, 18123
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "say five words please"}]


def stub(role: str, **kwargs: Any) -> TestClient:
    return TestClient(create_app(StubSettings(role=role, tokens=TOKENS, port=PORT, **kwargs)))


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "kimi-k3", "messages": MESSAGES, **fields})


def expected_text(n: int = TOKENS) -> str:
    return "".join(token_text(i) for i in range(n))


def sse_events(raw: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    events = parser.feed(raw)
    assert not parser.pending, "the stream ends inside an event"
    return events


def prefill_params(req: ChatCompletionRequest) -> KVTransferParams:
    reply = stub("prefill").post(CHAT, json=prefill_body(req))
    assert reply.status_code == 200, reply.text
    return KVTransferParams.from_dict(reply.json()["kv_transfer_params"])


def test_prefill_leg_returns_transfer_params() -> None:
    client = stub("prefill")
    req = chat_request(stream=True, stream_options={"include_usage": True})
    reply = client.post(CHAT, json=prefill_body(req))          # stream=False, max_tokens=1, do_remote_decode
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    body = ChatCompletion.model_validate(reply.json())
    assert body.choices[0].message.content == token_text(0) and body.usage.completion_tokens == 1
    ktp = body.kv_transfer_params
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert isinstance(ktp["remote_request_id"], str) and ktp["remote_request_id"]
    assert (ktp["remote_host"], ktp["remote_port"]) == ("127.0.0.1", PORT)
    assert client.get("/stats").json() == {"prefill": 1, "decode": 0, "local": 0}


def test_prefill_ids_are_unique() -> None:
    client = stub("prefill")
    body = prefill_body(chat_request())
    ids = {client.post(CHAT, json=body).json()["kv_transfer_params"]["remote_request_id"] for _ in range(3)}
    assert len(ids) == 3


def test_decode_leg_streams_chunks_then_done() -> None:
    req = chat_request(stream=True, stream_options={"include_usage": True})
    client = stub("decode")
    reply = client.post(CHAT, json=decode_body(req, prefill_params(req)))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.content)
    assert events[-1].is_done and not any(e.is_done for e in events[:-1])
    assert not any(e.is_error for e in events)
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_text()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    assert client.get("/stats").json() == {"prefill": 0, "decode": 1, "local": 0}


def test_decode_leg_whole_response() -> None:
    req = chat_request(max_tokens=3)
    reply = stub("decode").post(CHAT, json=decode_body(req, prefill_params(req)))
    assert reply.status_code == 200
    body = ChatCompletion.model_validate(reply.json())
    assert body.choices[0].message.content == expected_text(3) and body.choices[0].finish_reason == "length"
    assert body.kv_transfer_params is None


@pytest.mark.parametrize("stream", [False, True])
def test_completions_decode_only(stream: bool) -> None:
    req = CompletionRequest.model_validate({"prompt": "one two three", "stream": stream})
    reply = stub("decode").post("/v1/completions", json=wire_body(req))
    assert reply.status_code == 200
    if not stream:
        assert Completion.model_validate(reply.json()).choices[0].text == expected_text()
        return
    events = sse_events(reply.content)
    assert events[-1].is_done
    chunks = [CompletionChunk.model_validate(e.json()) for e in events[:-1]]
    assert "".join(c.choices[0].text for c in chunks) == expected_text()
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("role,body", [
    ("decode", prefill_body(chat_request())),                                            # D gets a P leg
    ("prefill", decode_body(chat_request(), KVTransferParams(do_remote_prefill=True, remote_request_id="r",
                                                               remote_host="127.0.0.1", remote_port=1))),
    ("decode", decode_body(chat_request(), KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1"))),
])
def test_wrong_or_malformed_leg_is_a_400_the_router_can_parse(role: str, body: dict[str, Any]) -> None:
    reply = stub(role).post(CHAT, json=body)
    assert reply.status_code == 400
    parsed = error_body(reply.content)
    assert parsed is not None and parsed["error"]["param"] == "kv_transfer_params"


def test_unknown_model_is_404() -> None:
    reply = stub("both").post(CHAT, json=wire_body(chat_request(model="other")))
    assert reply.status_code == 404 and error_body(reply.content)["error"]["code"] == "model_not_found"


def test_health_and_models() -> None:
    client = stub("both")
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["kimi-k3"]


def test_token_delay_paces_the_stream() -> None:
    client = stub("both", token_delay_s=0.02)
    start = time.perf_counter()
    reply = client.post(CHAT, json=wire_body(chat_request(stream=True)))
    assert reply.status_code == 200 and sse_events(reply.content)[-1].is_done
    assert time.perf_counter() - start >= TOKENS * 0.02
