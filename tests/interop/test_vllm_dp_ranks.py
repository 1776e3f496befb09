"""The router in front of one real vLLM API server with two data-parallel engines (`--data-parallel-size 2`,
`--data-parallel-ranks URL=2`): it places on each engine as a worker and pins every request with
`X-data-parallel-rank`. vLLM's own per-engine counters must show exactly the router's placements, and a
repeated prompt must go back to the engine holding its prefix (whose prefix-cache hits grow)."""
from __future__ import annotations

from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.interop.vllm_fleet import ADMIN, SERVED, VllmFleet

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def fleet(vllm_python, tiny_llama, tmp_path_factory):
    with VllmFleet(tmp_path_factory.mktemp("dp"), vllm_python, tiny_llama) as f:
        f.start_vllm("dp", None, ("--data-parallel-size", "2"))
        f.wait_all()
        url = f.urls["dp"]
        f.start_router("nixl", [], [], "--worker", url, "--data-parallel-ranks", f"{url}=2")
        yield f


def per_engine(url: str, name: str, **labels: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["engine"]] += s.value
    return dict(out)


def test_each_engine_is_a_worker_and_every_request_is_pinned_to_its_rank(fleet):
    router, server = fleet.urls["router"], fleet.urls["dp"]
    listed = httpx.get(router + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert sorted(w["worker_id"] for w in listed.json()["workers"]) == [f"{server}#dp0", f"{server}#dp1"]
    done_before = per_engine(server, "vllm:request_success_total")
    hits_before = per_engine(server, "vllm:prefix_cache_hits_total")
    prompts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 12 for i in range(8)]
    placed = []
    for prompt in [*prompts, *[prompts[0]] * 3]:
        resp = httpx.post(router + "/v1/completions", timeout=300,
                          json={"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        placed.append(resp.headers["x-kimi-pd-decode-worker"].rsplit("#dp", 1)[1])
    done = per_engine(server, "vllm:request_success_total")
    grown = {e: done[e] - done_before.get(e, 0) for e in done}
    assert grown == {e: float(placed.count(e)) for e in ("0", "1")}, (placed, grown)
    assert set(placed[:8]) == {"0", "1"}, "both engines were placed on"
    assert placed[8:] == [placed[0]] * 3, "a prompt goes back to the engine holding its prefix"
    hits = per_engine(server, "vllm:prefix_cache_hits_total")
    assert hits[placed[0]] - hits_before.get(placed[0], 0) >= 3 * 32, "its prefix cache served the repeats"
