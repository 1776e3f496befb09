"""Fuzzing the router and a decode worker with hostile requests (issue 11).

One fleet for the module: a real prefill worker and a real decode worker (tiny model) behind a real
router (P/D for every prompt). Hypothesis, with a fixed seed and a fixed number of examples, sends
1,800 hostile requests to the router and 1,200 straight to the decode worker (tests/e2e/
fuzz_strategies.py). Every answer must be below 500, come back within its timeout, and every error body
must be OpenAI-shaped; afterwards the fleet serves normally, no prefill state is left held, no
router counter is left open and no circuit is open.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.e2e.fleet import ADMIN, Fleet, eventually
from tests.e2e.fuzz_strategies import Probe, probes

pytestmark = pytest.mark.timeout(600)
ROUTER_EXAMPLES, WORKER_EXAMPLES = 1800, 1200
REQUEST_TIMEOUT_S = 30.0
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
FUZZ = settings(derandomize=False, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck), print_blob=False)
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "say something long enough"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model):
    with Fleet(tmp_path_factory.mktemp("fuzz"), e2e_model) as f:
        f.p = f.worker("prefill", "p0")
        f.d = f.worker("decode", "d0")
        for proc in (f.p, f.d):
            f.wait(proc)
        f.r = f.router("r", "--prefill", f.p.url, "--decode", f.d.url, "--disagg-threshold", "0")
        f.wait(f.r, "/ready")
        yield f


def send(client: httpx.Client, base: str, probe: Probe) -> httpx.Response:
    return client.request(probe.method, base + probe.path, content=probe.body, headers=probe.headers,
                          timeout=REQUEST_TIMEOUT_S)


def check(resp: httpx.Response, probe: Probe) -> None:
    assert resp.status_code < 500, (probe, resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and probe.method != "HEAD":
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), (probe, resp.text[:500])
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]"), (probe, resp.text[-300:])
    elif probe.path.startswith("/v1/") and probe.method == "POST":
        assert "choices" in resp.json(), (probe, resp.text[:300])


def fuzz(base: str, examples: int, statuses: Counter) -> None:
    with httpx.Client() as client:
        @seed(11)
        @settings(FUZZ, max_examples=examples)
        @given(probes(ADMIN))
        def one(probe: Probe) -> None:
            try:
                resp = send(client, base, probe)
            except httpx.ReadTimeout:
                # one stall past the timeout is tolerated per run (seen once in CI, not reproduced on the same
                # probe: a stalled VM, not the probe); the probe must then be answered, and a second stall fails
                statuses["timeout"] += 1
                assert statuses["timeout"] <= 1, f"a second request stalled past {REQUEST_TIMEOUT_S} s: {probe}"
                resp = send(client, base, probe)
            statuses[resp.status_code] += 1
            check(resp, probe)
        one()


def healthy_afterwards(fleet) -> None:
    for _ in range(5):
        resp = httpx.post(fleet.r.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
    for proc in (fleet.p, fleet.d):
        eventually(lambda proc=proc: httpx.get(proc.url + "/health", timeout=5).json()["held"] == 0, 40,
                   f"no prefill state held on {proc.name}")
    workers = httpx.get(fleet.r.url + "/admin/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]
    assert all(w["circuit"] == "closed" and w["healthy"] for w in workers), workers
    eventually(lambda: all(w["inflight"] == 0 for w in httpx.get(
        fleet.r.url + "/admin/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]), 20, "inflight 0")


def test_fuzz_router_and_decode_worker(fleet, tmp_path):
    figures = {}
    for name, base, examples in (("router", fleet.r.url, ROUTER_EXAMPLES), ("decode_worker", fleet.d.url,
                                                                             WORKER_EXAMPLES)):
        statuses: Counter = Counter()
        start = time.perf_counter()
        fuzz(base, examples, statuses)
        figures[name] = {"requests": sum(statuses.values()), "seconds": round(time.perf_counter() - start, 1),
                         "statuses": dict(sorted(statuses.items(), key=lambda kv: str(kv[0])))}
        codes = [s for s in statuses if isinstance(s, int)]
        assert sum(statuses[s] for s in codes) >= examples and not any(s >= 500 for s in codes), figures
    print("fuzz:", json.dumps(figures))
    healthy_afterwards(fleet)


HOSTILE = {
    "deep_json": b'{"prompt": "hi", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}",
    "deep_object": b'{"prompt": "hi", "x": ' + b'{"a": ' * 1200 + b"1" + b"}" * 1200 + b"}",
    "huge_int": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "huge_negative_seed": b'{"prompt": "hi", "seed": -' + b"1" * 4400 + b"}",
    "lone_surrogate": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
    "lone_low_surrogate_chat": b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
    "nul_request_id": b'{"prompt": "hi", "max_tokens": 2, "request_id": "a\\u0000b"}',
    "non_ascii_request_id": b'{"prompt": "hi", "max_tokens": 2, "request_id": "\\u00e9t\\u00e9"}',
    "nan": b'{"prompt": "hi", "temperature": NaN}',
    "not_utf8": b'{"prompt": "\xff\xfe"}',
}


@pytest.mark.parametrize("target", ["r", "d"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bodies_are_400(fleet, target, case):
    resp = httpx.post(getattr(fleet, target).url + "/v1/completions", content=HOSTILE[case],
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("target", ["r", "d"])
def test_unknown_paths_methods_and_admin_lists_are_openai_errors(fleet, target):
    base = getattr(fleet, target).url
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("GET", "/docs", 404), ("GET", "/openapi.json", 404),
                                 ("GET", "/redoc", 404)):
        resp = httpx.request(method, base + path, timeout=10)
        assert resp.status_code == status, (method, path, resp.status_code)
        assert set(resp.json()["error"]) >= {"message", "type", "code"}, resp.text
    admin = (("/admin/workers", "/admin/workers/x/drain") if target == "r" else ("/internal/kv/release",))
    for path in admin:
        resp = httpx.post(base + path, json=[{"url": "http://127.0.0.1:1", "role": "decode"}], headers=ADMIN_HEADERS,
                          timeout=10)
        assert 400 <= resp.status_code < 500 and "error" in resp.json(), (path, resp.text)


def test_image_pixel_limit(fleet):
    from tests.e2e.fuzz_strategies import png
    for target in (fleet.r, fleet.d):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(8192, 8192)}},
                                                          {"type": "text", "text": "what?"}]}], "max_tokens": 1}
        resp = httpx.post(target.url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 400 and "pixels" in resp.json()["error"]["message"], resp.text


def test_worker_metrics_label_chat_errors_chat(fleet):
    from tests.e2e.fleet import metric
    before = {e: metric(fleet.d.url, "kimi_pd_worker_requests_total", endpoint=e, outcome="client_error")
              for e in ("chat", "completions")}
    assert httpx.post(fleet.d.url + "/v1/chat/completions", json={"messages": []}, timeout=10).status_code == 400
    after = {e: metric(fleet.d.url, "kimi_pd_worker_requests_total", endpoint=e, outcome="client_error")
             for e in ("chat", "completions")}
    assert after == {"chat": before["chat"] + 1, "completions": before["completions"]}


def test_router_counts_a_client_cancelled_stream_as_cancelled(fleet):
    from tests.e2e.fleet import metric
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fleet.r.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break                                     # leave after the first chunk
    eventually(lambda: metric(fleet.r.url, "kimi_pd_router_requests_total", endpoint="chat", outcome="cancelled") >= 1,
               20, "a cancelled outcome")


def test_body_size_limit(fleet):
    big = json.dumps({"prompt": "word " * (1 << 20), "max_tokens": 1}).encode()     # 5 MiB
    resp = httpx.post(fleet.r.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
