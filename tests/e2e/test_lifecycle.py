"""Client disconnects abort both legs; auth on client and admin endpoints; per-leg metrics;
SIGTERM deregisters a worker from the store."""
from __future__ import annotations

import signal
import uuid

import httpx
import pytest

from tests.e2e.fleet import ADMIN, Fleet, eventually, metric

pytestmark = pytest.mark.timeout(300)
LONG = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 3000,
        "ignore_eos": True, "temperature": 0}




@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model, pd_fleet):
    """The package's P/D workers behind a router of this module's own that wants client API keys."""
    with Fleet(tmp_path_factory.mktemp("life"), e2e_model) as f:
        f.p, f.d = pd_fleet.p, pd_fleet.d
        f.r = f.router("r", "--prefill", f.p.url, "--decode", f.d.url, "--disagg-threshold", "0",
                       env={"KIMI_PD_API_KEYS": "key-one,key-two"})
        f.wait(f.r, "/ready")
        yield f


AUTH = {"authorization": "Bearer key-two"}


def idle(fleet) -> bool:
    return (metric(fleet.d.url, "kimi_pd_worker_running") == 0 and metric(fleet.d.url, "kimi_pd_worker_waiting") == 0
            and metric(fleet.p.url, "kimi_pd_kv_held_leases") == 0 and metric(fleet.p.url, "kimi_pd_worker_held") == 0)


def test_client_api_keys_and_admin_token_are_enforced(fleet):
    body = {**LONG, "max_tokens": 2}
    assert httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"},
                       timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(fleet.r.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(fleet.r.url + "/admin/workers", headers=AUTH, timeout=5).status_code == 401
    listed = httpx.get(fleet.r.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
    assert {w["role"] for w in listed.json()["workers"]} == {"prefill", "decode"}
    assert httpx.post(fleet.p.url + "/internal/kv/release", json={"request_id": "x"}, timeout=5).status_code == 401


def test_streaming_client_disconnect_aborts_both_legs(fleet):
    with httpx.stream("POST", fleet.r.url + "/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 3:
                break                                    # leaving the block closes the connection
    eventually(lambda: idle(fleet), what="decode worker to abort and prefill to hold nothing")
    assert metric(fleet.d.url, "kimi_pd_worker_requests_total", outcome="aborted") >= 1


def test_non_streaming_client_disconnect_aborts_both_legs(fleet):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.r.url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=1.5))
    eventually(lambda: idle(fleet), timeout_s=15, what="both legs aborted after the client left")


def test_per_leg_metrics_are_exported(fleet):
    assert httpx.post(fleet.r.url + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, headers=AUTH,
                      timeout=30).status_code == 200
    for name in ("kimi_pd_router_prefill_seconds_count", "kimi_pd_router_transfer_seconds_count",
                 "kimi_pd_router_decode_queue_seconds_count", "kimi_pd_router_ttft_seconds_count",
                 "kimi_pd_router_e2e_seconds_count"):
        assert metric(fleet.r.url, name) >= 1, name
    assert metric(fleet.r.url, "kimi_pd_router_decisions_total", decision="prefill-decode") >= 1
    assert metric(fleet.p.url, "kimi_pd_kv_transfers_total") >= 1
    assert metric(fleet.d.url, "kimi_pd_worker_kv_pull_seconds_count") >= 1
    for url in (fleet.r.url, fleet.p.url, fleet.d.url):       # the stall watch ticks in every server
        assert metric(url, "kimi_pd_router_event_loop_lag_seconds_count" if url == fleet.r.url
                      else "kimi_pd_worker_event_loop_lag_seconds_count") >= 1, url


def test_sigterm_deregisters_the_worker(tmp_path, e2e_model, redis_url):
    with Fleet(tmp_path, e2e_model, redis_url, namespace=uuid.uuid4().hex) as f:
        w = f.worker("worker", "w0")
        r = f.router("r")
        f.wait(w)
        f.wait(r, "/ready")
        import os
        os.killpg(w.popen.pid, signal.SIGTERM)
        admin = {"authorization": f"Bearer {ADMIN}"}
        eventually(lambda: httpx.get(r.url + "/admin/workers", headers=admin, timeout=5).json()["workers"] == [],
                   timeout_s=3, what="deregistration at the start of shutdown (faster than the 5 s TTL)")
        # then it drains (up to its 30 s graceful window) and exits; uvicorn re-raises the signal after a
        # clean shutdown, so -SIGTERM is the clean exit code
        assert w.popen.wait(45) in (0, -signal.SIGTERM), w.tail()
