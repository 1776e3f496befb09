"""The engine across hosts: prefill-1 is a TP=2 engine (experts split whole over the ranks too:
--enable-expert-parallel) whose second rank runs headless on another host (--nnodes 2
--master-addr/--master-port, as torch.distributed takes them); it feeds a TP=1
decode worker on a third host. Greedy tokens equal the TP=1 colocated engine; the ranks meet over
the bridge, never loopback."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kimi_pd.multihost.fleet import ConnectionSampler
from tests.e2e.fleet import completion_ids_body, greedy_ids
from tests.multihost.conftest import open_fleet, shared_tmp

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 8
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(21, 41), (22, 53)]]


@pytest.fixture(scope="module")
def tp_fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    yield from open_fleet(shared_tmp(tmp_path_factory, "mh-tp"), mh_model, prefill=1, decode=1, routers=1,
                          prefill_nodes=2, expert_parallel=True)


def test_tp2_prefill_over_two_hosts_feeds_a_decode_on_a_third(tp_fleet, offline):
    expected = greedy_ids(offline, PROMPTS, MAX_TOKENS)
    got = []
    with ConnectionSampler(tp_fleet) as sampler, tp_fleet.client() as http:
        for prompt in PROMPTS:
            resp = http.post(tp_fleet.url("lb") + "/v1/completions", json=completion_ids_body(prompt, MAX_TOKENS))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
            got.append(resp.json()["choices"][0]["token_ids"])
    assert got == expected
    assert not [c for c in sampler.seen if c.loopback]
    rank_links = {(c.host, c.peer.rpartition(":")[0]) for c in sampler.seen
                  if c.host in ("prefill-1", "tp-node-1")}
    assert ("tp-node-1", tp_fleet.host("prefill-1").addr) in rank_links, "the ranks meet over the bridge"
