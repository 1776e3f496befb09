"""The chaos run's CI form (benchmarks/chaos.py for 2 minutes). Not part of the default run, which must stay
short: it runs with `-m chaos` or `KIMI_PD_CHAOS=1` (`.ci/run` does, after the default suite)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: mixed traffic under injected faults (run with -m chaos)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    enabled = os.environ.get("KIMI_PD_CHAOS") == "1" or "chaos" in (config.getoption("-m") or "").replace(
        "not chaos", "")
    skip = pytest.mark.skip(reason="chaos run: run with -m chaos (or KIMI_PD_CHAOS=1)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.chaos)
            if not enabled:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("chaos-model") / "tiny", seed=0, progress=False)
