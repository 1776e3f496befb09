"""The router in front of stock vLLM with ExampleConnector (KV through a shared-storage path): the
prefill answers `kv_transfer_params: null` by design, and the decode instance finds the prompt's
KV in the store by itself. The router must treat that as P/D (no fallback counted), and the
answers must equal one vLLM instance's."""
from __future__ import annotations

import httpx
import pytest

from tests.interop.test_vllm_nixl import answer, post, requests_for, routed_answer
from tests.interop.vllm_fleet import VllmFleet, metric

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def fleet(vllm_python, tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("example")
    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp / "kv-store")}}
    with VllmFleet(tmp, vllm_python, tiny_llama) as f:
        for name in ("p", "d"):
            f.start_vllm(name, config)
        f.wait_all()
        f.start_router("example", ["p"], ["d"])
        yield f


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_through_shared_storage_equals_one_vllm_instance(fleet, stream):
    router, single = fleet.urls["router"], fleet.urls["p"]
    loaded_before = metric(fleet.urls["d"], "vllm:external_prefix_cache_hits_total")
    for path, body in requests_for(400 + 10 * stream):
        expected = answer(post(single, path, {**body, "cache_salt": "baseline"}))
        got, headers = routed_answer(router, path, body, stream)
        assert headers["x-kimi-pd-decision"] == "prefill-decode", headers
        assert got == expected and got, (path, got, expected)
    loaded = metric(fleet.urls["d"], "vllm:external_prefix_cache_hits_total") - loaded_before
    assert loaded >= 2 * 32, f"the decode instance loaded {loaded} prompt tokens from the shared store"
    text = httpx.get(router + "/metrics", timeout=60).text
    assert "kimi_pd_router_prefill_fallbacks_total{" not in text, "a null answer was counted as a fallback"
