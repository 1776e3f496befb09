"""Through the router with P/D == one worker alone == the offline LLM, token for token; streamed
chunks concatenate to the non-streamed answer; bad input gets OpenAI 4xx and harms nothing."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from engine import SamplingParams
from tests.e2e.fleet import Fleet, metric

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 12


def png_data_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(1)}},
                                  {"type": "text", "text": "What is in this picture?"}]}],
]


@pytest.fixture(scope="module")
def fleet(pd_fleet, tmp_path_factory, e2e_model):
    """The package's fleet (`p`, `d`, `r`, the colocated `w`); a router this module adds is its own."""
    with Fleet(tmp_path_factory.mktemp("eq"), e2e_model) as own:
        own.p, own.d, own.r, own.w = pd_fleet.p, pd_fleet.d, pd_fleet.r, pd_fleet.w
        yield own


def chat_body(messages, **extra):
    return {"model": "kimi-k3", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": True, **extra}


def token_bytes_of(response: dict) -> list[bytes]:
    return [bytes(entry["bytes"]) for entry in response["choices"][0]["logprobs"]["content"]]


def stream_text(url: str, body: dict) -> tuple[str, list[dict]]:
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True, "logprobs": False}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = ""
    for e in events:
        for choice in e["choices"]:
            delta = choice.get("delta", {})
            text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
    return text, events


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_router_pd_equals_single_worker_equals_offline(fleet, offline, index):
    messages = CHATS[index]
    via_router = httpx.post(fleet.r.url + "/v1/chat/completions", json=chat_body(messages), timeout=60)
    assert via_router.status_code == 200, via_router.text
    assert via_router.headers["x-kimi-pd-decision"] == "prefill-decode"
    assert via_router.headers["x-kimi-pd-prefill-worker"] == fleet.p.url
    alone = httpx.post(fleet.w.url + "/v1/chat/completions", json=chat_body(messages), timeout=60).json()
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            thinking=True)[0].output.token_ids
    expected_bytes = [offline.tokenizer.token_bytes(t) for t in expected]
    assert token_bytes_of(via_router.json()) == token_bytes_of(alone) == expected_bytes
    usage = via_router.json()["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] > 0
    assert "prompt_tokens_details" in usage


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_streamed_chunks_concatenate_to_the_whole_answer(fleet, index):
    body = chat_body(CHATS[index], logprobs=False)
    whole = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    text, events = stream_text(fleet.r.url + "/v1/chat/completions", body)
    assert text == (whole.get("reasoning_content") or "") + (whole.get("content") or "")
    assert len(events) > 3                              # really streamed, chunk by chunk
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_through_router_equal_offline(fleet, offline):
    prompt = "The lighthouse keeper walked along the shore and counted the boats"
    body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    got = httpx.post(fleet.r.url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200 and got.headers["x-kimi-pd-decision"] == "prefill-decode"
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got.json()["choices"][0]["text"] == expected[0].output.text


def test_no_prefill_state_left_held(fleet):
    assert metric(fleet.p.url, "kimi_pd_kv_held_leases") == 0
    assert metric(fleet.p.url, "kimi_pd_worker_held") == 0


@pytest.mark.parametrize("send, status, kind", [
    (lambda url: httpx.post(url + "/v1/chat/completions", content=b'{"messages": [', timeout=10), 400,
     "invalid_request_error"),
    (lambda url: httpx.post(url + "/v1/chat/completions", json=chat_body(CHATS[0], model="gpt-9"), timeout=10), 404,
     "invalid_request_error"),
    (lambda url: httpx.post(url + "/v1/chat/completions", json={"model": "kimi-k3"}, timeout=10), 400,
     "invalid_request_error"),
    (lambda url: httpx.post(url + "/v1/completions", json={"prompt": [5] * 5000, "max_tokens": 4}, timeout=30), 400,
     "invalid_request_error"),
    (lambda url: httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": -3}, timeout=10), 400,
     "invalid_request_error"),
    (lambda url: httpx.post(url + "/v1/chat/completions", json=chat_body(CHATS[0], temperature=-1), timeout=10), 400,
     "invalid_request_error"),
])
def test_bad_input_gets_openai_errors_and_services_keep_serving(fleet, send, status, kind):
    resp = send(fleet.r.url)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == kind and error["message"]
    ok = httpx.post(fleet.r.url + "/v1/chat/completions", json=chat_body(CHATS[0], max_tokens=2), timeout=60)
    assert ok.status_code == 200
    assert metric(fleet.p.url, "kimi_pd_kv_held_leases") == 0


def test_conditional_disaggregation_skips_prefill_for_short_prompts(fleet, offline):
    """A router with the default threshold sends short prompts straight to the decode worker."""
    r2 = fleet.router("r-threshold", "--prefill", fleet.p.url, "--decode", fleet.d.url, "--disagg-threshold", "32")
    fleet.wait(r2, "/ready")
    body = {"model": "kimi-k3", "prompt": "Short one", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    short = httpx.post(r2.url + "/v1/completions", json=body, timeout=60)
    assert short.headers["x-kimi-pd-decision"] == "decode-only"
    expected = offline.generate("Short one", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert short.json()["choices"][0]["text"] == expected[0].output.text
    long_body = {**body, "prompt": "word " * 60}
    assert httpx.post(r2.url + "/v1/completions", json=long_body, timeout=60).headers["x-kimi-pd-decision"] == \
        "prefill-decode"
