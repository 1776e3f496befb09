"""Two minutes of mixed traffic on a `kimi-pd up` fleet while a fault is injected every 12-20 s (every kind of
fault at least once): no request answered wrongly, truncated silently or left hanging, and the fleet whole and
holding nothing at the end. The 10-minute form is `python -m benchmarks.chaos`."""
from __future__ import annotations

import pytest

from benchmarks.chaos import FAULTS, ChaosConfig, run
from shared.net import free_port

pytestmark = pytest.mark.timeout(600)


def test_two_minutes_of_chaos(tmp_path, e2e_model):
    report = run(ChaosConfig(minutes=2.0, seed=3, fault_every_s=(12.0, 20.0)), e2e_model, tmp_path, free_port())
    assert report.violations == [], report.violations[:5]
    assert report.end_state.get("recovered"), report.end_state
    injected = {f["fault"] for f in report.faults if "skipped" not in f}
    assert injected == set(FAULTS), report.faults                      # every kind of fault happened
    assert report.outcomes["ok"] >= 100, report.outcomes                # real traffic was served throughout
