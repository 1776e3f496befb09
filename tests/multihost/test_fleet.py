"""The fleet across hosts: LB (host lb) -> router (two hosts) -> prefill (two hosts) -> decode (two
hosts), the store on its own host. Every connection between roles crosses the bridge; answers equal
the colocated engine token for token; both routers share one view of the fleet."""
from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from engine import SamplingParams
from kimi_pd.multihost.fleet import ConnectionSampler
from kimi_pd.multihost.netns import inside
from tests.e2e.test_equivalence import CHATS

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 12
PROMPT = " ".join(["the lighthouse keeper counted the boats along the shore"] * 6)   # > the disagg threshold


def completion(fleet, url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}
    with fleet.client() as http:
        return http.post(url + "/v1/completions", json=body)


def streamed(fleet, url: str, path: str, body: dict) -> tuple[str, list[dict], dict]:
    events, text = [], ""
    with fleet.client() as http, http.stream("POST", url + path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        headers = dict(resp.headers)
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    for e in events:
        for choice in e.get("choices", []):
            delta = choice.get("delta") or {}
            text += choice.get("text") or (delta.get("reasoning_content") or "") + (delta.get("content") or "")
    return text, events, headers


def test_every_connection_between_roles_crosses_the_bridge(fleet):
    with ConnectionSampler(fleet) as sampler:
        for i in range(4):                      # round robin: both routers, and P/D pairs on several hosts
            resp = completion(fleet, fleet.url("lb"), f"{i} {PROMPT}")
            assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
    loopback = [c for c in sampler.seen if c.loopback]
    assert not loopback, f"connections over 127.0.0.1: {loopback}"
    edges = fleet.edges(sampler.seen)
    roles = {(src.split("-")[0], dst.split("-")[0], port) for src, dst, port in edges}
    expected = {("lb", "router", 8000), ("router", "prefill", 8101), ("router", "decode", 8201),
                ("decode", "prefill", 9101), ("router", "store", 6379), ("prefill", "store", 6379),
                ("decode", "store", 6379)}
    assert expected <= roles, f"missing: {expected - roles}"
    assert {dst for src, dst, port in edges if src == "lb"} == {"router-1", "router-2"}


def test_workers_register_their_advertised_addresses(fleet):
    for router in fleet.role_hosts("router"):
        with fleet.client() as http:
            workers = http.get(fleet.url(router) + "/admin/workers", headers=fleet.admin_headers()).json()["workers"]
        got = {w["worker_id"]: w["url"] for w in workers}
        names = fleet.role_hosts("prefill") + fleet.role_hosts("decode")
        assert got == {fleet.worker_id(n): fleet.url(n) for n in names}


def test_store_needs_its_password_and_is_on_its_own_host(fleet):
    store = fleet.host("store").addr
    with inside(fleet.host("client").ns):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=store, port=6379, socket_timeout=2).set("k", "v")
        assert redis.Redis.from_url(fleet.redis_url, socket_timeout=2).ping()


def test_completions_across_hosts_equal_the_colocated_engine_whole_and_streamed(fleet, offline):
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    resp = completion(fleet, fleet.url("lb"), PROMPT)
    assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode"
    assert resp.json()["choices"][0]["text"] == expected[0].output.text
    body = {"model": "kimi-k3", "prompt": "x " + PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    text, events, _ = streamed(fleet, fleet.url("lb"), "/v1/completions", body)
    expected = offline.generate("x " + PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert text == expected[0].output.text and len(events) > 3


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_chats_with_images_across_hosts_equal_the_colocated_engine(fleet, offline, index):
    messages = CHATS[index]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = offline.chat(messages, params, thinking=True)[0].output
    body = {"model": "kimi-k3", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with fleet.client() as http:
        resp = http.post(fleet.url("lb") + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    whole = (message.get("reasoning_content") or "") + (message.get("content") or "")
    text, _, _ = streamed(fleet, fleet.url("lb"), "/v1/chat/completions", body)
    assert whole == text == out.text or whole == text and out.text.endswith(message.get("content") or "")


def test_a_repeated_prefix_goes_back_to_its_host_from_either_router(fleet):
    prompt = "affinity " + PROMPT
    first = completion(fleet, fleet.url("router-1"), prompt)
    assert first.status_code == 200
    holder = first.headers["x-kimi-pd-prefill-worker"]
    time.sleep(1.0)                             # KV events reach the store, both routers poll it
    placed = []
    for router in ("router-1", "router-2", "router-2", "router-1"):
        resp = completion(fleet, fleet.url(router), prompt + " and then some more words")
        assert resp.status_code == 200
        placed.append((resp.headers["x-kimi-pd-decision"], resp.headers.get("x-kimi-pd-prefill-worker")))
    assert all(worker == holder for _, worker in placed), f"first on {holder}, then {placed}"
    assert len(set(placed)) == 1, f"both routers place alike: {placed}"


def test_no_prefill_state_left_held(fleet):
    from tests.e2e.fleet import metric
    for name in fleet.role_hosts("prefill"):
        with inside(fleet.host("client").ns):
            assert metric(fleet.url(name), "kimi_pd_kv_held_leases") == 0


def test_a_chat_with_tools_across_hosts_equals_the_colocated_engine_token_for_token(fleet, offline):
    from tests.e2e.test_equivalence import token_bytes_of
    from tests.e2e.test_openai_surface import CLOCK, WEATHER
    messages = [{"role": "user", "content": "What is the weather in Paris? " + PROMPT}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = offline.chat(messages, params, tools=[WEATHER, CLOCK], thinking=True)[0].output.token_ids
    body = {"model": "kimi-k3", "messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    with fleet.client() as http:
        resp = http.post(fleet.url("lb") + "/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
    assert token_bytes_of(resp.json()) == [offline.tokenizer.token_bytes(t) for t in ids]
