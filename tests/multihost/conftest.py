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

from tests.opt_in import OptInSuite

SUITE = OptInSuite("multi-host suite", "multihost", "KIMI_PD_MULTIHOST", "across namespace hosts",
                   Path(__file__).resolve().parent)

pytest_configure = SUITE.register                    # the marker's help line
pytest_collection_modifyitems = SUITE.mark           # marked, and skipped unless asked for


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
def mh_model(tiny_dir) -> Path:
    return tiny_dir


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


def shared_tmp(tmp_path_factory, name: str) -> Path:
    """A fresh temporary folder that the namespaces' processes (other users' views of it) can read."""
    tmp = tmp_path_factory.mktemp(name)
    tmp.chmod(0o755)
    return tmp


@pytest.fixture(scope="module")
def fleet(namespaces, mh_model, tmp_path_factory) -> Iterator:
    yield from open_fleet(shared_tmp(tmp_path_factory, "mh"), mh_model)


@pytest.fixture(scope="session")
def offline(mh_model):
    from tests.e2e.fleet import offline_llm
    return offline_llm(mh_model)
