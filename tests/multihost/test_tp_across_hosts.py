"""The engine across hosts: prefill-1 is a TP=2 engine (experts split whole over the ranks too:
--enable-expert-parallel) whose second rank runs headless on another host (--nnodes 2
--master-addr/--master-port, as torch.distributed takes them); it feeds a TP=1
decode worker on a third host. Greedy tokens equal the TP=1 colocated engine; the ranks meet over
the bridge, never loopback."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engine import SamplingParams
from kimi_pd.multihost.fleet import ConnectionSampler
from tests.multihost.conftest import open_fleet

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 8
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(21, 41), (22, 53)]]


@pytest.fixture(scope="module")
def tp_fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    tmp = tmp_path_factory.mktemp("mh-tp")
    tmp.chmod(0o755)
    yield from open_fleet(tmp, mh_model, prefill=1, decode=1, routers=1, prefill_nodes=2, expert_parallel=True)


def test_tp2_prefill_over_two_hosts_feeds_a_decode_on_a_third(tp_fleet, offline):
    expected = [o.output.token_ids for o in offline.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    got = []
    with ConnectionSampler(tp_fleet) as sampler, tp_fleet.client() as http:
        for prompt in PROMPTS:
            resp = http.post(tp_fleet.url("lb") + "/v1/completions", json={
                "model": "kimi-k3", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
            got.append(resp.json()["choices"][0]["token_ids"])
    assert got == expected
    assert not [c for c in sampler.seen if c.loopback]
    rank_links = {(c.host, c.peer.rpartition(":")[0]) for c in sampler.seen
                  if c.host in ("prefill-1", "tp-node-1")}
    assert ("tp-node-1", tp_fleet.host("prefill-1").addr) in rank_links, "the ranks meet over the bridge"
