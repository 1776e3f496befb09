"""The multi-host suite: the fleet spread over network namespaces ("hosts") on a private bridge.

Not part of the default run (it needs root for `ip netns`, and starts a whole fleet per module): it
runs with `-m multihost` or `KIMI_PD_MULTIHOST=1` (`.ci/run` does, after the interop suite). Where
namespaces cannot be created the tests skip and say why, unless KIMI_PD_MULTIHOST_REQUIRED=1 (CI),
where that is a failure instead.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers",
                            "multihost: across namespace hosts (run with -m multihost or KIMI_PD_MULTIHOST=1)")


def _enabled(config: pytest.Config) -> bool:
    return os.environ.get("KIMI_PD_MULTIHOST") == "1" or "multihost" in (config.getoption("-m") or "").replace(
        "not multihost", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="multi-host suite: run with -m multihost (or KIMI_PD_MULTIHOST=1)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.multihost)
            if not _enabled(config):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def namespaces() -> None:
    """Skip (fail in CI) when this machine cannot make network namespaces."""
    from kimi_pd.multihost.netns import unavailable_reason
    reason = unavailable_reason()
    if reason and os.environ.get("KIMI_PD_MULTIHOST_REQUIRED") == "1":
        pytest.fail(f"KIMI_PD_MULTIHOST_REQUIRED=1 but {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def mh_model(tmp_path_factory) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("mh-model") / "tiny", seed=0, progress=False)


def open_fleet(tmp: Path, model: Path, **spec: object) -> Iterator:
    """A started MultiHostFleet; everything it made (processes, namespaces, bridge) is gone afterwards,
    also when the start or the test failed."""
    from kimi_pd.multihost.fleet import FleetSpec, MultiHostFleet
    from kimi_pd.multihost.netns import leftover_namespaces
    fleet = MultiHostFleet(FleetSpec(model, tmp, **spec))   # type: ignore[arg-type]
    with fleet:
        yield fleet
    assert not leftover_namespaces(fleet.net.prefix), "namespaces left behind"
    assert all(c.popen.poll() is not None for c in fleet.procs.children), "processes left behind"


@pytest.fixture(scope="module")
def fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    tmp = tmp_path_factory.mktemp("mh")
    tmp.chmod(0o755)
    yield from open_fleet(tmp, mh_model)


@pytest.fixture(scope="session")
def offline(mh_model):
    from tests.e2e.fleet import offline_llm
    return offline_llm(mh_model)
