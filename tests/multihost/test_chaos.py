"""The chaos run across hosts, short form: mixed traffic through the LB while one host's link at a time goes
down and comes back (a decode host, a prefill host, the store host, a router host). Every 200 is the reference
answer, every failure explicit, nothing hangs; afterwards every router sees every worker and nothing is held
(benchmarks/chaos_multihost.py; its 10-minute form's results are in benchmarks/results/)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.chaos_multihost import FAULTS, MultiHostChaosConfig, run
from tests.multihost.conftest import open_fleet, shared_tmp

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    yield from open_fleet(shared_tmp(tmp_path_factory, "mh-chaos"), mh_model)


def test_links_down_and_up_under_mixed_traffic(fleet):
    config = MultiHostChaosConfig(minutes=1.5, seed=1, fault_every_s=(6.0, 10.0), link_down_s=(3.0, 6.0), clients=2)
    report = run(fleet, config)
    assert report.violations == [], report.violations[:5]
    assert report.end_state.get("recovered"), report.end_state
    kinds = {f["host"].split("-")[0] for f in report.faults}
    assert kinds == set(FAULTS), report.faults                  # every kind of host unplugged at least once
    assert report.outcomes["ok"] > 20, dict(report.outcomes)
