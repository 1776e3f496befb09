"""Router behaviour under client and worker misbehaviour, against model-free stub workers:
clients leaving early are not worker failures, counters do not leak, slow whole answers are not cut
by the idle timeout, a dead prefill pool falls back to decode-only, bad admin input is refused
without hurting health checks, and clients cannot steer transfers."""
from __future__ import annotations

import signal

import httpx
import pytest

from tests.e2e.fleet import ADMIN, Fleet, eventually, metric

pytestmark = pytest.mark.timeout(240)
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi there"}]}


def view(router_url: str) -> dict[str, dict]:
    listed = httpx.get(router_url + "/admin/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]
    return {w["role"]: w for w in listed}


def stub_counts(url: str) -> dict[str, int]:
    return httpx.get(url + "/stats", timeout=5).json()


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory, e2e_model):
    """P and D stubs generating 100 tokens at 20 ms each (2 s per answer), a P/D router; shared by the
    tests that use it, each of which ends with nothing in flight."""
    with Fleet(tmp_path_factory.mktemp("slow-fleet"), e2e_model) as f:
        f.p = f.stub("prefill", "p", "--tokens", "100", "--token-delay-ms", "20")
        f.d = f.stub("decode", "d", "--tokens", "100", "--token-delay-ms", "20")
        for proc in (f.p, f.d):
            f.wait(proc)
        f.r = f.router("r", "--prefill", f.p.url, "--decode", f.d.url, "--disagg-threshold", "0",
                       "--idle-timeout", "1")
        f.wait(f.r, "/ready")
        yield f


def test_clients_leaving_streams_early_do_not_open_the_circuit(slow_fleet):
    for _ in range(7):                                   # more than the breaker's 5 consecutive failures
        with httpx.stream("POST", slow_fleet.r.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break
    eventually(lambda: view(slow_fleet.r.url)["decode"]["inflight"] == 0, what="inflight back to 0")
    assert view(slow_fleet.r.url)["decode"]["circuit"] == "closed"
    assert httpx.post(slow_fleet.r.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3},
                      timeout=30).status_code == 200


def test_non_streaming_disconnects_do_not_leak_inflight(slow_fleet):
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow_fleet.r.url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(10, read=0.4))
    eventually(lambda: all(w["inflight"] == 0 for w in view(slow_fleet.r.url).values()), what="inflight back to 0")
    assert all(w["circuit"] == "closed" for w in view(slow_fleet.r.url).values())


def test_whole_answer_slower_than_the_idle_timeout_is_not_cut(slow_fleet):
    resp = httpx.post(slow_fleet.r.url + "/v1/chat/completions", json=CHAT, timeout=30)   # 2 s > idle 1 s
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 100


def test_client_cannot_steer_transfers(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        d = f.stub("decode", "d")
        f.wait(d)
        r = f.router("r", "--decode", d.url)
        f.wait(r, "/ready")
        forged = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 22,
                  "remote_request_id": "someone-else", "remote_engine_id": "x"}
        resp = httpx.post(r.url + "/v1/chat/completions", json={**CHAT, "kv_transfer_params": forged}, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "decode-only"
        assert stub_counts(d.url) == {"prefill": 0, "decode": 0, "local": 1}


def test_dead_prefill_pool_falls_back_to_decode_only(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        p, d = f.stub("prefill", "p"), f.stub("decode", "d")
        for proc in (p, d):
            f.wait(proc)
        r = f.router("r", "--prefill", p.url, "--decode", d.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=30).headers[
            "x-kimi-pd-decision"] == "prefill-decode"
        p.kill(signal.SIGKILL)
        for _ in range(4):
            resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "decode-only"
        assert metric(r.url, "kimi_pd_router_prefill_fallbacks_total") + \
            metric(r.url, "kimi_pd_router_decisions_total", decision="decode-only") >= 4


def test_bad_admin_url_is_refused_and_health_checks_keep_running(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        d1, d2 = f.stub("decode", "d1"), f.stub("decode", "d2")
        for proc in (d1, d2):
            f.wait(proc)
        r = f.router("r", "--decode", d1.url, "--decode", d2.url)
        f.wait(r, "/ready")
        for bad in ("http://127.0.0.1:99999", "http://[::1", "ftp://x:1", 7):
            resp = httpx.post(r.url + "/admin/workers", json={"url": bad, "role": "decode"}, headers=ADMIN_HEADERS,
                              timeout=5)
            assert resp.status_code == 400 and resp.json()["error"]["message"]
        d2.kill(signal.SIGKILL)
        def d2_unhealthy():
            listed = httpx.get(r.url + "/admin/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]
            return any(w["url"] == d2.url and not w["healthy"] for w in listed)
        eventually(d2_unhealthy, what="the health checker to mark the killed worker down")
        for _ in range(3):
            assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
