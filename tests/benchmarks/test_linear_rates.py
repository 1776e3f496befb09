"""benchmarks/linear_rates.py: every product it times is the product it names, and its table reads the JSON."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import linear_rates
from engine.model import rowdot
from engine.model.gemm import PACK_ROWS


def test_one_shape_measured_for_each_kernel_and_row_count(monkeypatch):
    monkeypatch.setattr(linear_rates, "CACHE_BYTES", 1 << 20)          # a few small weights: quick
    result = linear_rates.measure((64, 256), [1, 2, 3], repeats=1)
    assert result["shape"] == [64, 256] and result["weights"] == 16
    kernels = {"rowdot", "panels", "panels_in_cache"} if rowdot.kernel() else set()
    expected = {"onednn_packed", "onednn", "aten"} | kernels
    assert set(result["rows"]) == {"1", "2", "3"}
    for cell in result["rows"].values():
        assert set(cell) == expected
        for rate in cell.values():
            assert rate["us"] > 0 and rate["gb_per_s"] == pytest.approx(64 * 256 * 4 / rate["us"] / 1e3)
    assert result["sum_gb_per_s"] > 0
    products = linear_rates.products(torch.zeros(1, 8), [torch.zeros(4, 8)] * 3, [], rowdot.kernel(),
                                     [torch.zeros(1)] * 3 if rowdot.kernel() else [])
    if rowdot.kernel():                      # the ceiling: one panel copy, called as often as all of them
        in_cache = products["panels_in_cache"][0]
        assert len(in_cache) == 3 and len({id(p) for p in in_cache}) == 1
    lines = linear_rates.table([result]).splitlines()
    assert len(lines) == 2 + 3 and lines[2].startswith("| 64x256 | 1 | ")
    assert lines[2].endswith("x |") == bool(rowdot.kernel())           # best kernel / packed where they ran


def test_every_product_is_the_linear_it_names():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 256, generator=gen), torch.randn(64, 256, generator=gen)
    kernel = rowdot.kernel()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)]
    panels = [kernel.pack(w)] if kernel is not None else []
    with torch.inference_mode():
        for name, (weights, call) in linear_rates.products(x, [w], packed, kernel, panels).items():
            torch.testing.assert_close(call(weights[0]), F.linear(x, w), rtol=1e-5, atol=1e-4, msg=name)
