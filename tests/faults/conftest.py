"""The fault suite: fleets of real processes whose workers, routers and stores are killed, stopped or scaled
away (`kimi-pd up` under SIGKILL, pools that grow and shrink, the chaos run's 2-minute CI form). Each test runs
whole fleets for a minute or more, so the suite is not part of the default run, which must stay under ten
minutes on two cores: it runs with `-m faults` or `KIMI_PD_FAULTS=1` (`.ci/run` does, after the default suite)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.opt_in import OptInSuite

SUITE = OptInSuite("fault suite", "faults", "KIMI_PD_FAULTS", "fleets under killed processes and injected faults",
                   Path(__file__).resolve().parent)


def pytest_configure(config: pytest.Config) -> None:
    SUITE.register(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    SUITE.mark(config, items)


