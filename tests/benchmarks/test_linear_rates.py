"""benchmarks/linear_rates.py: every product it times is the product it names, and its table reads the JSON."""
from __future__ import annotations

import pytest

from benchmarks import linear_rates
from engine.model import rowdot


def test_one_shape_measured_for_each_kernel_and_row_count(monkeypatch):
    monkeypatch.setattr(linear_rates, "CACHE_BYTES", 1 << 20)          # a few small weights: quick
    result = linear_rates.measure((64, 256), [1, 2, 3], repeats=1)
    assert result["shape"] == [64, 256] and result["weights"] == 16
    expected = {"onednn_packed", "onednn", "aten"} | ({"rowdot"} if rowdot.kernel() else set())
    assert set(result["rows"]) == {"1", "2", "3"}
    for cell in result["rows"].values():
        assert set(cell) == expected
        for rate in cell.values():
            assert rate["us"] > 0 and rate["gb_per_s"] == pytest.approx(64 * 256 * 4 / rate["us"] / 1e3)
    assert result["sum_gb_per_s"] > 0
    lines = linear_rates.table([result]).splitlines()
    assert len(lines) == 2 + 3 and lines[2].startswith("| 64x256 | 1 | ")
    assert lines[2].endswith("x |") == bool(rowdot.kernel())           # rowdot / packed where it ran
