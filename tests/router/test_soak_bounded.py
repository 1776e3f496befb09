"""A router's memory over a soak: thousands of requests (P/D and decode-only, streamed and whole, fan-outs,
a fresh prompt and client id each) through an in-process router in front of stub workers leave every
structure the router keeps per request or per prompt within its bound: the approximate prefix index at
its capacity, the begin/end events of workers that never report load, the hash-chain memo, the
sampling-check memo, metric label sets, and nothing left in flight (leases renewed, background tasks,
in-flight counts). Sizes, not timings. The issue saw RSS rise for ten minutes; these were what grew."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import uvicorn

from router import registry as registry_module
from router.app import create_app
from router.settings import RouterSettings
from shared import hashing
from tests.router.test_front import _serve
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app

REQUESTS, CONCURRENCY = 1000, 8
CACHE_TOKENS, BLOCK = 64 * 16, 16            # 64 blocks of the approximate index per worker
MAX_EVENTS, MAX_LINKS = 256, 512


def _body(i: int) -> tuple[str, dict]:
    text = f"request {i} " * 12                  # a fresh prompt of several blocks every time
    if i % 4 == 3:
        return "/v1/completions", {"model": "kimi-k3", "prompt": [text, text + "!"], "max_tokens": 2}
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            "request_id": f"client-{i}", "stream": i % 2 == 0}
    return "/v1/chat/completions", body


async def _drive(url: str) -> list[int]:
    statuses: list[int] = []
    queue = iter(range(REQUESTS))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def worker() -> None:
            for i in queue:
                path, body = _body(i)
                reply = await client.post(path, json=body)
                statuses.append(reply.status_code)
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return statuses


@pytest.fixture
def fleet(monkeypatch):
    monkeypatch.setattr(registry_module._SinceReport, "MAX_EVENTS", MAX_EVENTS)
    monkeypatch.setattr(hashing, "MAX_LINKS", MAX_LINKS)
    servers: list[uvicorn.Server] = []
    try:
        urls = {}
        for role in ("prefill", "decode"):
            urls[role], server = _serve(stub_app(StubSettings(role=role, tokens=3)))
            servers.append(server)
        settings = RouterSettings(model=None, static_prefill=(urls["prefill"],), static_decode=(urls["decode"],),
                                  disagg_threshold_tokens=40, static_cache_tokens=CACHE_TOKENS, block_size=BLOCK,
                                  admin_token="admin-token")
        app = create_app(settings)
        url, server = _serve(app)
        servers.append(server)
        yield url, app
    finally:
        for server in servers:
            server.should_exit = True


def test_router_structures_stay_bounded_over_thousands_of_requests(fleet):
    url, app = fleet
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.extend(asyncio.run(_drive(url))))
    thread.start()
    thread.join(timeout=600)
    assert len(statuses) == REQUESTS and set(statuses) == {200}
    st = app.state
    orchestrator, registry = st.orchestrator, st.orchestrator.registry
    samples = set(_label_sets(st.metrics))
    for worker_id in registry.all_infos():
        assert len(registry.index.approximate._lru.get(worker_id, {})) <= CACHE_TOKENS // BLOCK
        assert len(registry._since[worker_id].events) <= MAX_EVENTS
        assert registry.inflight.get(worker_id, 0) == 0
    assert max(len(registry.index.approximate._lru[w]) for w in registry.all_infos()) == CACHE_TOKENS // BLOCK
    assert len(hashing._LINKS) <= MAX_LINKS
    assert len(st.sampling_check._accepted) <= st.sampling_check.max_keys
    assert orchestrator.leases.held() == 0 and not orchestrator._background
    assert len(samples) < 300                   # label sets by endpoint/decision/outcome/worker, never per request


def _label_sets(metrics) -> list[tuple]:
    """Every (metric, labels) sample the router exports: a bounded set whatever the traffic."""
    return [(s.name, tuple(sorted(s.labels.items()))) for family in metrics.registry.collect() for s in family.samples]
