"""The opt-in suites (faults, monitoring, interop, multihost): runs too heavy for the default suite's ten
minutes on two cores, each in its own folder and run as its own CI step (`.ci/run`).

A suite's conftest names it once; every test under that folder then carries the marker, and is skipped
unless `-m MARKER` selects it or `$ENV=1` is set (`-m "not MARKER"` keeps it skipped)."""
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

    def register(self, config: pytest.Config) -> None:
        config.addinivalue_line("markers", f"{self.marker}: {self.what} (run with -m {self.marker} or {self.env}=1)")

    def enabled(self, config: pytest.Config) -> bool:
        expr = (config.getoption("-m") or "").replace(f"not {self.marker}", "")
        return os.environ.get(self.env) == "1" or self.marker in expr

    def mark(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Mark the suite's tests; skip them where the run did not ask for the suite."""
        skip = pytest.mark.skip(reason=f"{self.name}: run with -m {self.marker} (or {self.env}=1)")
        enabled = self.enabled(config)
        for item in items:
            if self.folder in Path(item.path).resolve().parents:
                item.add_marker(getattr(pytest.mark, self.marker))
                if not enabled:
                    item.add_marker(skip)
