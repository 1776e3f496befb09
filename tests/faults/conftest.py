"""The fault suite: fleets of real processes whose workers, routers and stores are killed, stopped or scaled
away (`kimi-pd up` under SIGKILL, pools that grow and shrink, the chaos run's 2-minute CI form). Each test runs
whole fleets for a minute or more, so the suite is not part of the default run, which must stay under ten
minutes on two cores: it runs with `-m faults` or `KIMI_PD_FAULTS=1` (`.ci/run` does, after the default suite)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "faults: fleets under killed processes and injected faults (run with -m faults)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    enabled = os.environ.get("KIMI_PD_FAULTS") == "1" or "faults" in (config.getoption("-m") or "").replace(
        "not faults", "")
    skip = pytest.mark.skip(reason="fault suite: run with -m faults (or KIMI_PD_FAULTS=1)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.faults)
            if not enabled:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("faults-model") / "tiny", seed=0, progress=False)
