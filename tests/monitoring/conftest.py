"""The monitoring suite: a real Prometheus (Debian's `prometheus` package) scraping a `kimi-pd up` fleet on
loopback, with deploy/monitoring's alert rules loaded, and every Grafana dashboard query and alert expression
evaluated against what it scraped. About a minute on two cores (a fleet start, traffic, scrapes), so it is
not part of the default run: it runs with `-m monitoring` or `KIMI_PD_MONITORING=1` (`.ci/run` does)."""
from __future__ import annotations

from pathlib import Path

from tests.opt_in import OptInSuite

SUITE = OptInSuite("monitoring suite", "monitoring", "KIMI_PD_MONITORING", "a real Prometheus scraping a fleet",
                   Path(__file__).resolve().parent)

pytest_configure = SUITE.register                    # the marker's help line
pytest_collection_modifyitems = SUITE.mark           # marked, and skipped unless asked for
