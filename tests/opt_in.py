"""The opt-in suites (faults, monitoring, interop, multihost, parallel): runs too heavy for the default suite's
ten minutes on two cores, each run as its own CI step (`.ci/run`).

A suite is named once (in its folder's conftest, or in tests/conftest.py when its files live beside default
tests); every test under its paths then carries the marker, as does a single test marked by hand
(`@pytest.mark.parallel` in a default file), and is skipped unless `-m MARKER` selects it or `$ENV=1` is set
(`-m "not MARKER"` keeps it skipped). A test marked by hand outside its suite's folder is skipped only
where the conftest naming that suite is loaded: tests/conftest.py's suites (parallel) always are."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class OptInSuite:
    name: str       # "fault suite": how the skip reason names it
    marker: str     # the pytest marker every test under `folder` gets
    env: str        # the switch that enables it without -m
    what: str       # the marker's help line
    folder: Path
    files: tuple[Path, ...] = ()    # more paths (files or folders) outside `folder`

    def register(self, config: pytest.Config) -> None:
        config.addinivalue_line("markers", f"{self.marker}: {self.what} (run with -m {self.marker} or {self.env}=1)")

    def enabled(self, config: pytest.Config) -> bool:
        expr = (config.getoption("-m") or "").replace(f"not {self.marker}", "")
        return os.environ.get(self.env) == "1" or self.marker in expr

    def mark(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Mark the suite's tests; skip them where the run did not ask for the suite."""
        skip = pytest.mark.skip(reason=f"{self.name}: run with -m {self.marker} (or {self.env}=1)")
        enabled = self.enabled(config)
        paths = (self.folder, *self.files)
        for item in items:
            path = Path(item.path).resolve()
            if any(p == path or p in path.parents for p in paths):
                item.add_marker(getattr(pytest.mark, self.marker))
            if item.get_closest_marker(self.marker) is not None and not enabled:    # also a test marked by hand
                item.add_marker(skip)
