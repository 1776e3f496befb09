"""Faults with processes really killed: a decode worker dies mid-stream, a prefill worker dies, the
store goes away and comes back. Afterwards no prefill state is left held."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import uuid

import httpx
import pytest

from shared.store.embedded import EmbeddedValkey
from tests.e2e.fleet import ADMIN, Fleet, eventually, metric

pytestmark = pytest.mark.timeout(300)


def chat(url: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Ping?"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)




def no_prefill_state_held(url: str) -> bool:
    return metric(url, "kimi_pd_kv_held_leases") == 0 and metric(url, "kimi_pd_worker_held") == 0


def stream_and_kill(url: str, body: dict, procs: dict, after_events: int = 5):
    """Stream `body`, SIGKILL the decode worker serving it after `after_events` data events; the lines."""
    lines, killed = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        victim = procs[resp.headers["x-kimi-pd-decode-worker"]]
        for line in resp.iter_lines():
            lines.append(line)
            if killed is None and sum(x.startswith("data: {") for x in lines) >= after_events:
                victim.kill(signal.SIGKILL)
                killed = victim
    assert killed is not None
    return lines, killed


def relayed(lines: list[str]) -> tuple[list[int], str, list[dict]]:
    """Token ids, content and usage chunks of a streamed chat answer."""
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    return ids, text, [c["usage"] for c in chunks if c.get("usage")]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_decode_worker_killed_mid_stream_is_migrated(tmp_path, e2e_model, sampling):
    """P/D stream; its decode worker is SIGKILLed: the router resumes it on the other decode worker
    from the tokens already relayed, and the client's stream equals the uninterrupted answer, greedy or
    seeded (the continuing worker skips one draw of the seed per delivered token)."""
    with Fleet(tmp_path, e2e_model) as f:
        p, d1, d2 = f.worker("prefill", "p0"), f.worker("decode", "d1"), f.worker("decode", "d2")
        for proc in (p, d1, d2):
            f.wait(proc)
        r = f.router("r", "--prefill", p.url, "--decode", d1.url, "--decode", d2.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, **sampling}
        lines, killed = stream_and_kill(r.url, body, {d1.url: d1, d2.url: d2})
        assert "event: error" not in lines, lines[-5:]
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        ids, text, usage = relayed(lines)
        reference = httpx.post(r.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                               timeout=120).json()
        assert reference["choices"][0]["token_ids"] == ids and len(ids) == 400
        assert reference["choices"][0]["message"]["content"] == text
        assert len(usage) == 1 and usage[0]["completion_tokens"] == 400
        assert metric(r.url, "kimi_pd_router_migrations_total", outcome="ok") == 1
        assert len({json.loads(x[6:])["id"] for x in lines if x.startswith("data: {")}) == 1
        eventually(lambda: no_prefill_state_held(p.url), what="no prefill state held")


def test_decode_worker_killed_while_generating_a_whole_answer_is_retried(tmp_path, e2e_model):
    """P/D, not streamed, seeded: the decode worker answers only at the end, so its death lands before any
    byte of the answer. The router asks the other decode worker, decode-only, and the client gets the same
    200 an uninterrupted run gives; the prefill state the dead worker held is freed by its lease."""
    with Fleet(tmp_path, e2e_model) as f:
        p = f.worker("prefill", "p0", "--kv-lease-s", "5")
        d1, d2 = f.worker("decode", "d1"), f.worker("decode", "d2")
        for proc in (p, d1, d2):
            f.wait(proc)
        r = f.router("r", "--prefill", p.url, "--decode", d1.url, "--decode", d2.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "seed": 11, "return_token_ids": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, r.url + "/v1/chat/completions", json=body, timeout=120)
            busy = eventually(lambda: next((d for d in (d1, d2) if metric(d.url, "kimi_pd_worker_running") >= 1),
                                           None), what="a decode worker generating")
            time.sleep(0.3)                                       # some tokens in, none sent
            busy.kill(signal.SIGKILL)
            resp = answer.result()
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
        survivor = d2 if busy is d1 else d1
        assert resp.headers["x-kimi-pd-decode-worker"] == survivor.url
        reference = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert resp.json()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
        assert len(reference["choices"][0]["token_ids"]) == 300
        assert metric(r.url, "kimi_pd_router_migrations_total", outcome="ok") == 1
        eventually(lambda: no_prefill_state_held(p.url), what="no prefill state held")


def test_only_decode_worker_killed_mid_stream_ends_with_an_sse_error(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        p, d = f.worker("prefill", "p0"), f.worker("decode", "d1")
        for proc in (p, d):
            f.wait(proc)
        r = f.router("r", "--prefill", p.url, "--decode", d.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        lines, _ = stream_and_kill(r.url, body, {d.url: d})
        assert "event: error" in lines, lines[-5:]
        error = json.loads(lines[lines.index("event: error") + 1][6:])["error"]
        assert error["code"] == "decode_failed" and "mid-stream" in error["message"]
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert metric(r.url, "kimi_pd_router_migrations_total", outcome="failed") == 1
        assert metric(r.url, "kimi_pd_router_requests_total", endpoint="chat", outcome="error") == 1
        eventually(lambda: no_prefill_state_held(p.url), what="no prefill state held")


def test_prefill_worker_killed_next_requests_go_elsewhere(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        p1, p2, d = f.worker("prefill", "p1"), f.worker("prefill", "p2"), f.worker("decode", "d")
        for proc in (p1, p2, d):
            f.wait(proc)
        r = f.router("r", "--prefill", p1.url, "--prefill", p2.url, "--decode", d.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        assert chat(r.url).status_code == 200
        p1.kill(signal.SIGKILL)
        for i in range(6):
            resp = chat(r.url, max_tokens=3, seed=i)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kimi-pd-prefill-worker"] == p2.url
            assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        eventually(lambda: no_prefill_state_held(p2.url), what="no prefill state held")


def test_store_stopped_and_restarted_requests_keep_being_served(tmp_path, e2e_model):
    store = EmbeddedValkey().start()
    try:
        with Fleet(tmp_path, e2e_model, store.url, namespace=uuid.uuid4().hex) as f:
            p, d = f.worker("prefill", "p0"), f.worker("decode", "d0")
            r = f.router("r", "--disagg-threshold", "0")
            for proc in (p, d):
                f.wait(proc)
            f.wait(r, "/ready")

            def router_lists_both() -> bool:
                listed = httpx.get(r.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"},
                                   timeout=5).json()["workers"]
                return {w["worker_id"] for w in listed} == {"p0", "d0"}
            # /ready needs a decode worker; the prefill worker is placed once the router's refresh lists it
            eventually(router_lists_both, what="the router to list both workers")
            assert chat(r.url).headers["x-kimi-pd-decision"] == "prefill-decode"
            store.stop()
            time.sleep(1.0)                                  # several refreshes and heartbeats fail
            for _ in range(3):
                resp = chat(r.url)
                assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode"
            assert httpx.get(r.url + "/ready", timeout=5).json()["store"] == "unavailable"
            store.start()                                    # same port, empty: workers must re-register
            def recovered():
                ready = httpx.get(r.url + "/ready", timeout=5).json()
                listed = httpx.get(r.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"},
                                   timeout=5).json()["workers"]
                return ready["store"] == "ok" and {w["worker_id"] for w in listed} == {"p0", "d0"}
            eventually(recovered, what="store recovery and re-registration")
            for _ in range(3):
                assert chat(r.url).status_code == 200
            eventually(lambda: no_prefill_state_held(p.url), what="no prefill state held")
    finally:
        store.stop()
