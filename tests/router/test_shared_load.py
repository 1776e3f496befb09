"""Router replicas in front of one static fleet place as one router does: each shares, through the store,
what it sent each static worker (in-flight legs, open work) and adds the others' to its own
(router/registry.py `_share_load`). Equivalence with a stated tolerance: the same requests placed through
one router and through two give the same placement once a send has reached the store (one refresh
interval, 0.1 s here; a placement made inside that window can still differ); without the store two routers
do not (the negative control that shows the test can fail)."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.settings import RouterSettings
from shared.store.memory import InMemoryStore
from tests.router.fake_vllm import Servers
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app

MODEL_DIR = Path(__file__).resolve().parents[2] / "engine" / "presets_data" / "tiny-chat"
BIG = "big " * 3000


class Stub:
    """A decode stub worker whose answers take 2.5 s, so every leg is still open when the last is placed."""

    def __init__(self) -> None:
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self):
        return stub_app(StubSettings(role="decode", tokens=2, first_token_delay_s=2.5))


def router(workers: list[Stub], redis_url: str | None, namespace: str) -> TestClient:
    settings = RouterSettings(model=str(MODEL_DIR), static_decode=tuple(w.url for w in workers),
                              store_url=redis_url, namespace=namespace, refresh_s=0.1, health_check_s=5.0,
                              disagg_threshold_tokens=10 ** 6, prefill_tokens_per_s=1000.0,
                              static_cache_tokens=1 << 20, placement_headers=True)
    return TestClient(create_app(settings))


def until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sent(client: TestClient) -> int:
    return sum(client.app.state.registry.inflight.values())


def placed(big_via: TestClient, small_via: TestClient, shared: bool) -> tuple[str, list[str]]:
    """A big prompt through one router, then two small ones through another (or the same): where each went.
    Every answer takes 2.5 s, so all three legs are open when the last one is placed."""
    where: dict[str, str] = {}

    def send(client: TestClient, key: str, prompt: str) -> None:
        resp = client.post("/v1/completions", json={"model": "kimi-k3", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        where[key] = resp.headers["x-kimi-pd-decode-worker"]
    threads = [threading.Thread(target=send, args=(big_via, "big", BIG))]
    threads[0].start()
    until(lambda: sent(big_via) == 1, "the big leg")
    if shared:                                       # the next refresh (0.1 s) shares it
        until(lambda: sum(n for n, _ in small_via.app.state.registry.peers.values()) == 1, "the shared view")
    for i in range(2):
        threads.append(threading.Thread(target=send, args=(small_via, f"small{i}", f"small{i} " * 300)))
        threads[-1].start()
        until(lambda i=i: sent(small_via) == i + 1 + (small_via is big_via), f"small leg {i}")
    for t in threads:
        t.join(30)
    return where["big"], [where["small0"], where["small1"]]


def test_two_routers_place_as_one_and_without_the_store_they_do_not(redis_url):
    workers = [Stub(), Stub()]
    namespace = f"shared-load-{uuid.uuid4().hex[:8]}"
    with Servers(*workers):
        with router(workers, None, namespace + "-one") as one:
            big, smalls = placed(one, one, False)
        assert smalls == [w.url for w in workers if w.url != big] * 2, "one router: the small ones avoid the big one"
        with router(workers, redis_url, namespace) as a, router(workers, redis_url, namespace) as b:
            big, smalls = placed(a, b, True)
        assert smalls == [w.url for w in workers if w.url != big] * 2, "two routers sharing place as one"
        with router(workers, None, namespace) as a, router(workers, None, namespace) as b:
            big, smalls = placed(a, b, False)
        assert big in smalls and len(set(smalls)) == 2, "two routers that do not share split the small ones"


def test_stale_replicas_drop_out_and_a_replica_never_counts_itself():
    now = [100.0]
    store = InMemoryStore(clock=lambda: now[0])

    async def go():
        assert await store.share_router_load("a", {"w": [2, 1.5]}, 2.0) == {}
        assert await store.share_router_load("b", {"w": [1, 0.5]}, 2.0) == {"a": {"w": [2, 1.5]}}
        now[0] += 3.0                               # a stopped sharing: gone after its ttl
        assert await store.share_router_load("b", {"w": [0, 0.0]}, 2.0) == {}
    asyncio.run(go())


def test_the_shared_view_reaches_placement(redis_url):
    """Another replica's open legs on a static worker show as in-flight and backlog here."""
    from router.registry import WorkerRegistry
    from shared.store.factory import make_store
    namespace = f"shared-view-{uuid.uuid4().hex[:8]}"
    settings = RouterSettings(model=None, static_decode=("http://w1", "http://w2"), store_url=redis_url,
                              namespace=namespace, prefill_tokens_per_s=1000.0)

    async def go():
        stores = [make_store(redis_url, namespace) for _ in range(2)]
        a, b = (WorkerRegistry(settings, s) for s in stores)
        a.begin("http://w1")
        a.ledger.open("http://w1", 3000)
        await a.refresh()
        await b.refresh()
        views = {s.worker_id: s for s in b.states()}
        for s in stores:
            await s.close()
        return views
    views = asyncio.run(go())
    assert views["http://w1"].inflight == 1 and views["http://w1"].backlog_s == pytest.approx(3.0, abs=0.2)
    assert views["http://w2"].inflight == 0 and views["http://w2"].backlog_s == 0.0
    assert httpx.URL("http://w1").host == "w1"
