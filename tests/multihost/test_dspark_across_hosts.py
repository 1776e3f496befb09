"""DSpark across hosts: prefill and decode workers on separate hosts, both with the draft (the
prefill's draft rows travel with the state); greedy answers through the LB equal the plain engine's."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine import SamplingParams
from kimi_pd.multihost.fleet import WORKER_TUNING
from kimi_pd.multihost.netns import inside
from tests.e2e.fleet import metric
from tests.multihost.conftest import open_fleet, shared_tmp

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 16
PROMPTS = [" ".join(["the lighthouse keeper counted the boats along the shore"] * 6), "1 2 3 4 5 " * 10]


@pytest.fixture(scope="module")
def spec_fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    from engine.spec_decode.checkpoint import create_draft_checkpoint
    tmp = shared_tmp(tmp_path_factory, "mh-dspark")
    draft = create_draft_checkpoint(mh_model, tmp / "draft7", block=7, seed=3)
    config = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 7})
    yield from open_fleet(tmp, mh_model, prefill=1, decode=1, routers=1,
                          worker_args=(*WORKER_TUNING, "--speculative-config", config))


def test_dspark_pd_across_hosts_equals_the_plain_engine(spec_fleet, offline):
    for prompt in PROMPTS:
        body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        with spec_fleet.client() as http:
            resp = http.post(spec_fleet.url("lb") + "/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
        expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert resp.json()["choices"][0]["text"] == expected[0].output.text
    with inside(spec_fleet.host("client").ns):
        assert metric(spec_fleet.url("decode-1"), "kimi_pd_worker_spec_decode_num_drafts_total") > 0
