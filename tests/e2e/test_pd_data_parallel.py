"""Data-parallel workers through the router, launched with vLLM's flags on loopback.

A `-dp 2` prefill worker whose DP rank 1 runs on a second, `--headless` "node" (same flags plus
`--data-parallel-start-rank 1`, meeting node 0 at `--data-parallel-address:--data-parallel-rpc-port`)
feeds a TP=1 decode worker; a TP=1 prefill feeds a `-dp 2` decode worker (both ranks local). Requests
sent together land on both DP ranks: each state exports from the DP rank that computed it and imports
into the DP rank the decode front chose, and every answer equals the colocated TP=1 engine's greedy
tokens. The decode workers run `--kv-load-failure-policy fail`, so a state that does not import
cannot hide behind a recompute.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from shared.net import free_port
from tests.e2e.fleet import Fleet, complete_ids, greedy_reference, metric, pd_routers

pytestmark = pytest.mark.timeout(420)
MAX_TOKENS = 6
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(21, 29), (22, 41), (23, 17), (24, 33)]]
DP = ("--enable-expert-parallel", "--data-parallel-size", "2")
STRICT = ("--kv-load-failure-policy", "fail")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model):
    with Fleet(tmp_path_factory.mktemp("pd-dp"), e2e_model) as f:
        port = str(free_port())
        across = (*DP, "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
                  "--data-parallel-rpc-port", port)
        f.p_dp = f.worker("prefill", "p-dp2", *across)
        f.node1 = f.worker("prefill", "p-dp2-node1", *across, "--data-parallel-start-rank", "1", "--headless")
        f.d1 = f.worker("decode", "d-tp1", *STRICT)
        f.p1 = f.worker("prefill", "p-tp1")
        f.d_dp = f.worker("decode", "d-dp2", *DP, *STRICT)
        for proc in (f.p_dp, f.d1, f.p1, f.d_dp):
            f.wait(proc, timeout_s=240)
        f.r_pdp, f.r_ddp = pd_routers(f, {"r-pdp-d1": (f.p_dp, f.d1), "r-p1-ddp": (f.p1, f.d_dp)})
        yield f


@pytest.fixture(scope="module")
def colocated(e2e_model) -> list[list[int]]:
    return greedy_reference(e2e_model, PROMPTS, MAX_TOKENS)


def placed(worker) -> list[int]:
    return httpx.get(worker.url + "/health", timeout=5).json()["data_parallel_placed"]


@pytest.mark.parametrize("pair", ["dp2-prefill-tp1-decode", "tp1-prefill-dp2-decode"])
def test_pd_with_data_parallel_equals_colocated(fleet, colocated, pair):
    router, prefill, decode, dp_worker = ((fleet.r_pdp, fleet.p_dp, fleet.d1, fleet.p_dp) if pair.startswith("dp2")
                                          else (fleet.r_ddp, fleet.p1, fleet.d_dp, fleet.d_dp))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:              # together: they spread over the DP ranks
        answers = list(pool.map(lambda p: complete_ids(router.url, p, MAX_TOKENS), PROMPTS))
    for got, expected in zip(answers, colocated, strict=True):
        assert got.status_code == 200, got.text
        assert got.headers["x-kimi-pd-decision"] == "prefill-decode"
        assert got.json()["choices"][0]["token_ids"] == expected
    assert all(n > 0 for n in placed(dp_worker)), placed(dp_worker)
    assert metric(decode.url, "kimi_pd_kv_pull_failures_total") == 0
    assert metric(prefill.url, "kimi_pd_kv_held_leases") == 0
    assert metric(prefill.url, "kimi_pd_worker_held") == 0


def test_headless_node_serves_nothing_and_front_reports_both_ranks(fleet):
    assert fleet.node1.popen.poll() is None                    # still running its DP rank
    with pytest.raises(httpx.HTTPError):
        httpx.get(fleet.node1.url + "/health", timeout=2)      # no HTTP server on a headless node
    health = httpx.get(fleet.p_dp.url + "/health", timeout=5).json()
    assert len(health["data_parallel_placed"]) == 2
