"""Circuit-breaker poisoning (issue 11): a client's input must never count as a worker failure.

The router used to copy the client's `request_id` into the `x-request-id` header it sends to workers;
a NUL made that header illegal, the send failed, and the failure was charged to both workers: 12 such
requests opened every circuit and the next normal requests got 503 for 30 s. Here 2 prefill + 2 decode
stub workers sit behind a real router; 12 poisoned requests (bad ids in the body and in the header)
are answered 4xx, then 10 normal requests all get 200 and every circuit is still closed.
"""
from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.fleet import ADMIN, Fleet, raw_post

pytestmark = pytest.mark.timeout(180)
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there, how are you"}], "max_tokens": 4}
POISONED_IDS = ["abc\u0000def", "\u00e9t\u00e9", "a b", "x" * 129, "line\r\nx-evil: 1", "", "\ud800", "tab\tid",
                "quote\"id", "\u0000", "emoji-\U0001F600", "del\u007f"]


@pytest.fixture()
def pd_fleet(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        stubs = [f.stub(role, f"{role}-{i}") for role in ("prefill", "decode") for i in range(2)]
        for proc in stubs:
            f.wait(proc)
        f.r = f.router("r", *(a for s in stubs for a in (f"--{s.name.split('-')[0]}", s.url)),
                       "--disagg-threshold", "0")
        f.wait(f.r, "/ready")
        yield f


def test_poisoned_request_ids_open_no_circuit(pd_fleet):
    url = pd_fleet.r.url + "/v1/chat/completions"
    for bad in POISONED_IDS:                              # 12 poisoned bodies
        resp = httpx.post(url, content=json.dumps({**CHAT, "request_id": bad}), timeout=30,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, (bad, resp.status_code, resp.text)
        error = resp.json()["error"]              # a lone surrogate is already refused as invalid JSON
        assert error["param"] == "request_id" or (bad == "\ud800" and "JSON" in error["message"]), error
    for header in (b"x-request-id: a\x00b", b"x-request-id: \xc3\xa9t\xc3\xa9", b"x-request-id: " + b"y" * 300):
        status = raw_post(pd_fleet.r.url, "/v1/chat/completions", json.dumps(CHAT).encode(), header)
        assert status.split()[1] in (b"200", b"400"), status   # a NUL header may be refused, never a 5xx
    for _ in range(10):
        resp = httpx.post(url, json=CHAT, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
    listed = httpx.get(pd_fleet.r.url + "/admin/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]
    assert len(listed) == 4 and all(w["circuit"] == "closed" for w in listed), listed


def test_router_ids_are_its_own(pd_fleet):
    resp = httpx.post(pd_fleet.r.url + "/v1/chat/completions", json={**CHAT, "request_id": "client-id-42"},
                      headers={"x-request-id": "hdr-7"}, timeout=30)
    assert resp.status_code == 200
    assert "client-id-42" not in resp.headers["x-request-id"] and "hdr-7" not in resp.headers["x-request-id"]
