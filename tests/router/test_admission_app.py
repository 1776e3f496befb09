"""Admission through a real router (uvicorn, the front protocol) in front of a stub worker: 401/429/503
answers and their headers, the queue's priority order end to end, accounting on /admin and /metrics."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from router.admission.http import admit
from router.admission.tenants import Tenant
from router.app import create_app
from router.settings import RouterSettings
from router.transport.front import front_protocol_class
from shared.openai.legs import wire_body
from shared.openai.requests import ChatCompletionRequest
from tests.router.test_front import _serve
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app

TENANTS = """
[tenants.acme]
keys = ["sk-acme-0001"]
rpm = 2
[tenants.gold]
keys = ["sk-gold-0001"]
priority = -1
[tenants.impatient]
keys = ["sk-impatient-01"]
queue_timeout_s = 0.3
"""
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
ADMIN = {"authorization": "Bearer admin-token"}


def key(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tenants = tmp_path_factory.mktemp("admission") / "tenants.toml"
    tenants.write_text(TENANTS)
    servers = []
    try:
        stub_url, stub = _serve(stub_app(StubSettings(role="both", tokens=20, token_delay_s=0.1)))
        servers.append(stub)
        settings = RouterSettings(model=None, static_both=(stub_url,), api_keys=("sk-client-0001",),
                                  admin_token="admin-token", tenants_file=str(tenants), max_inflight_per_worker=1,
                                  queue_timeout_s=20)
        app = create_app(settings)
        url, r = _serve(app, http=front_protocol_class(5.0, app, settings.max_request_bytes))
        servers.append(r)
        yield url
    finally:
        for server in servers:
            server.should_exit = True


def test_unknown_key_401_then_rate_limit_429_with_openai_headers(router):
    with httpx.Client(base_url=router, timeout=20) as client:
        assert client.post("/v1/chat/completions", json=CHAT, headers=key("sk-nobody-0001")).status_code == 401
        ok = client.post("/v1/chat/completions", json=CHAT, headers=key("sk-acme-0001"))
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-ratelimit-limit-requests"] == "2" and ok.headers["x-ratelimit-remaining-requests"] == "1"
        assert "x-kimi-pd-decode-worker" not in ok.headers          # keys are on: internal addresses stay inside
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                           headers=key("sk-acme-0001")) as stream:
            assert stream.status_code == 200 and stream.headers["x-ratelimit-remaining-requests"] == "0"
            assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        refused = client.post("/v1/chat/completions", json=CHAT, headers=key("sk-acme-0001"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        usage = client.get("/admin/tenants/acme", headers=ADMIN).json()
        assert usage["limits"]["rpm"] == 2 and usage["usage"]["requests"] == 2
        # 3 from the answer's usage; the stub's stream carries no token ids, so it is settled as reserved
        assert usage["usage"]["rejected"] == {"rate_limited": 1} and usage["usage"]["completion_tokens"] == 3
        assert client.get("/admin/tenants/acme").status_code == 401
        assert client.get("/dashboard/state", headers=ADMIN).json()["tenants"]["acme"]["requests"] == 2
        metrics = client.get("/metrics").text
        assert 'kimi_pd_router_tenant_rejections_total{reason="rate_limited",tenant="acme"} 1.0' in metrics


def test_queue_serves_the_better_class_first_and_times_out_with_503(router):
    async def scenario() -> tuple[list[str], httpx.Response]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=router, timeout=30) as client:
            async def send(name: str, k: str, priority: int = 0, tokens: int = 3) -> httpx.Response:
                body = {**CHAT, "priority": priority, "max_tokens": tokens}
                resp = await client.post("/v1/chat/completions", json=body, headers=key(k))
                order.append(name)
                return resp
            blocker = asyncio.create_task(send("blocker", "sk-client-0001", tokens=20))     # holds the slot 2 s
            await asyncio.sleep(0.1)
            lows = [asyncio.create_task(send(f"low{i}", "sk-client-0001", priority=5)) for i in range(4)]
            await asyncio.sleep(0.2)
            gold = asyncio.create_task(send("gold", "sk-gold-0001", priority=50))   # its class beats any request's
            late = await send("impatient", "sk-impatient-01")
            answers = await asyncio.gather(blocker, *lows, gold)
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return order, late
    start = time.monotonic()
    order, late = asyncio.run(scenario())
    assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
    assert int(late.headers["retry-after"]) >= 1
    served = [n for n in order if n != "impatient"]
    assert served[:2] == ["blocker", "gold"], served
    assert time.monotonic() - start < 15


def test_the_workers_get_the_effective_priority():
    async def run() -> tuple[dict, dict]:
        class Gate:
            async def enter(self, tenant, priority, prompt, max_tokens):
                return None
        req = ChatCompletionRequest.model_validate({**CHAT, "priority": 3})
        await admit(Gate(), Tenant("plain"), req, 4)                          # type: ignore[arg-type]
        plain = wire_body(req)
        req = ChatCompletionRequest.model_validate({**CHAT, "priority": 3})
        await admit(Gate(), Tenant("low", priority=2), req, 4)               # type: ignore[arg-type]
        return plain, wire_body(req)
    plain, classed = asyncio.run(run())
    assert plain["priority"] == 3 and classed["priority"] == Tenant("low", priority=2).effective_priority(3)
    assert "priority" not in wire_body(ChatCompletionRequest.model_validate(CHAT))    # drop-in: unset stays unset


def gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_client_that_leaves_the_queue_frees_its_place_and_no_slot_leaks(router):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=router, timeout=30) as client:
            body = {**CHAT, "max_tokens": 20}                                   # holds the slot 2 s
            blocker = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=key("sk-client-0001")))
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):                              # queued, then the client gives up
                await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers=key("sk-client-0001"), timeout=0.5)
            await asyncio.sleep(0.2)
            assert gauge((await client.get("/metrics")).text, "kimi_pd_router_admission_queue_depth") == 0
            assert (await blocker).status_code == 200
            # a stream whose client leaves after its headers gives its slot back too
            async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                                     headers=key("sk-client-0001")) as resp:
                assert resp.status_code == 200
            await asyncio.sleep(0.5)
            assert gauge((await client.get("/metrics")).text, "kimi_pd_router_admission_inflight") == 0
    asyncio.run(scenario())
