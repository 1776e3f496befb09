"""Placement with real workers and a real Valkey store: prefix affinity with cached tokens reported,
load beating prefix, two router replicas placing alike, a restarted router rebuilding its index."""
from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from tests.e2e.fleet import ADMIN, Fleet, eventually

pytestmark = pytest.mark.timeout(300)
PREFIX = [(7 * i + 3) % 1000 for i in range(120)]


def completion(url: str, suffix: list[int], max_tokens: int = 2) -> httpx.Response:
    body = {"model": "kimi-k3", "prompt": PREFIX + suffix, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def workers_view(router_url: str) -> dict[str, dict]:
    resp = httpx.get(router_url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
    return {w["worker_id"]: w for w in resp.json()["workers"]}




@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model, redis_url):
    with Fleet(tmp_path_factory.mktemp("place"), e2e_model, redis_url, namespace=uuid.uuid4().hex) as f:
        f.pa, f.pb, f.d = f.worker("prefill", "p-a"), f.worker("prefill", "p-b"), f.worker("decode", "d-0")
        f.r1, f.r2 = f.router("r1", "--disagg-threshold", "0"), f.router("r2", "--disagg-threshold", "0")
        for proc in (f.pa, f.pb, f.d, f.r1, f.r2):
            f.wait(proc)
        for r in (f.r1, f.r2):
            eventually(lambda r=r: len(workers_view(r.url)) == 3, what="router sees 3 workers")
            f.wait(r, "/ready")
        yield f


def test_shared_prefix_goes_to_the_worker_that_holds_it(fleet):
    first = completion(fleet.r1.url, [901, 902, 903])
    holder = first.headers["x-kimi-pd-prefill-worker"]
    assert holder in ("p-a", "p-b")
    eventually(lambda: workers_view(fleet.r1.url)[holder]["cached_blocks"] >= 28, what="KV events reach the router")
    for suffix in ([904, 905], [906, 907, 908], [909]):
        resp = completion(fleet.r1.url, suffix)
        assert resp.headers["x-kimi-pd-prefill-worker"] == holder
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
    fleet.holder = holder


def test_two_router_replicas_place_alike(fleet):
    holder = fleet.holder
    eventually(lambda: workers_view(fleet.r2.url)[holder]["cached_blocks"] >= 28, what="replica 2 sees the events")
    for suffix in ([911], [912, 913]):
        a, b = completion(fleet.r1.url, suffix), completion(fleet.r2.url, suffix)
        assert a.headers["x-kimi-pd-prefill-worker"] == b.headers["x-kimi-pd-prefill-worker"] == holder


def test_load_beats_prefix_when_the_holder_is_overloaded(fleet):
    holder = fleet.holder
    holder_url = {"p-a": fleet.pa.url, "p-b": fleet.pb.url}[holder]
    stop = threading.Event()

    def busy():                                        # long local generations straight on the holder
        body = {"model": "kimi-k3", "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", holder_url + "/v1/completions", json=body, timeout=120) as resp:
                for _ in resp.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(14)]
    for t in threads:
        t.start()
    try:
        def loaded():
            load = workers_view(fleet.r1.url)[holder]["load"] or {}
            return load.get("running", 0) + load.get("waiting", 0) >= 12
        eventually(loaded, what="the holder's load report")
        resp = completion(fleet.r1.url, [921, 922])
        assert resp.headers["x-kimi-pd-prefill-worker"] != holder
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    eventually(lambda: (workers_view(fleet.r1.url)[holder]["load"] or {}).get("running", 1) == 0,
               what="the holder to go idle again")


def test_restarted_router_rebuilds_its_index_from_the_store(fleet):
    holder = fleet.holder
    port = int(fleet.r1.url.rsplit(":", 1)[1])
    fleet.r1.kill()
    fresh = fleet.router("r1-again", "--disagg-threshold", "0", port=port)
    fleet.wait(fresh, "/ready")
    eventually(lambda: workers_view(fresh.url).get(holder, {}).get("cached_blocks", 0) >= 28,
               what="the new router to rebuild the prefix index")
    # the load-beats-prefix test before this one may have left the prefix on a second worker too: the
    # rebuilt index must know every holder, and the request must go to one of them
    holders = {w for w, v in workers_view(fresh.url).items() if v.get("cached_blocks", 0) >= 28}
    resp = completion(fresh.url, [931, 932, 933])
    assert holder in holders and resp.headers["x-kimi-pd-prefill-worker"] in holders
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
