"""The monitoring suite: a real Prometheus (Debian's `prometheus` package) scraping a `kimi-pd up` fleet on
loopback, with deploy/monitoring's alert rules loaded, and every Grafana dashboard query and alert expression
evaluated against what it scraped. About a minute on two cores (a fleet start, traffic, scrapes), so it is
not part of the default run: it runs with `-m monitoring` or `KIMI_PD_MONITORING=1` (`.ci/run` does)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "monitoring: a real Prometheus scraping a fleet (run with -m monitoring)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    enabled = os.environ.get("KIMI_PD_MONITORING") == "1" or "monitoring" in (config.getoption("-m") or "").replace(
        "not monitoring", "")
    skip = pytest.mark.skip(reason="monitoring suite: run with -m monitoring (or KIMI_PD_MONITORING=1)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.monitoring)
            if not enabled:
                item.add_marker(skip)
