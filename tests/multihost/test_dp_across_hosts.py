"""Data parallelism across hosts: prefill-1 is a `--data-parallel-size 2` engine (experts split whole
over both DP ranks) whose DP rank 1 runs `--headless --data-parallel-start-rank 1` on another host,
meeting prefill-1 at `--data-parallel-address:--data-parallel-rpc-port`; it feeds a TP=1 decode worker
on a third host. Requests land on both DP ranks; greedy tokens equal the colocated
engine's, and the ranks meet over the bridge, never loopback."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kimi_pd.multihost.fleet import ConnectionSampler
from tests.e2e.fleet import completion_ids_body, greedy_ids
from tests.multihost.conftest import open_fleet, shared_tmp

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 6
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(31, 41), (32, 45), (33, 49), (34, 53)]]


@pytest.fixture(scope="module")
def dp_fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    yield from open_fleet(shared_tmp(tmp_path_factory, "mh-dp"), mh_model, prefill=1, decode=1, routers=1,
                          prefill_nodes=2, data_parallel=True)


def test_dp2_prefill_over_two_hosts_feeds_a_decode_on_a_third(dp_fleet, offline):
    expected = greedy_ids(offline, PROMPTS, MAX_TOKENS)
    with ConnectionSampler(dp_fleet) as sampler, dp_fleet.client() as http:
        answers = [http.post(dp_fleet.url("lb") + "/v1/completions", json=completion_ids_body(prompt, MAX_TOKENS))
                   for prompt in PROMPTS]                      # an idle front alternates its DP ranks
        health = http.get(dp_fleet.url("prefill-1") + "/health", headers=dp_fleet.admin_headers()).json()
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
    assert [r.json()["choices"][0]["token_ids"] for r in answers] == expected
    assert all(n > 0 for n in health["data_parallel_placed"]), health
    assert not [c for c in sampler.seen if c.loopback]
    rank_links = {(c.host, c.peer.rpartition(":")[0]) for c in sampler.seen if c.host == "tp-node-1"}
    assert ("tp-node-1", dp_fleet.host("prefill-1").addr) in rank_links, "the DP ranks meet over the bridge"
