"""engine/model/gemm.py: the CPU linears on oneDNN agree with aten's, and fall back where they must."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model import gemm, rowdot
from engine.model.gemm import Linear, linear

ROOT = Path(__file__).resolve().parents[3]
ONEDNN = gemm.BACKEND != "aten"


BIG = gemm.ONEDNN_MIN_WEIGHT_ELEMENTS // 256          # rows of a [BIG, 256] weight: just on oneDNN


@pytest.mark.parametrize(("shape", "out"), [((1, 256), BIG), ((7, 256), BIG), ((2, 3, 256), BIG), ((256,), BIG),
                                            ((0, 256), BIG), ((3, 256), 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_aten(shape, out, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=gen), torch.randn(out, 256, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    with torch.inference_mode():
        got = linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert got.shape == (*shape[:-1], out)


def test_fused_row_views_and_transposed_weights():
    """A fused tensor's member is a row view (oneDNN takes it); a transposed view goes to aten."""
    fused = torch.randn(3 * BIG, 256)
    x = torch.randn(rowdot.linear_max_rows() + 1, 256)          # rows for oneDNN (fewer run on the rowdot kernel)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, fused[BIG:2 * BIG]), F.linear(x, fused[BIG:2 * BIG]), atol=1e-4, rtol=1e-5)
        transposed = torch.randn(256, BIG).t()                  # [BIG, 256], not row-major
        torch.testing.assert_close(linear(x, transposed), F.linear(x, transposed))


def test_training_keeps_autograd():
    """Outside inference the product must be differentiable: the aten path, same gradients."""
    layer = Linear(256, BIG, bias=True)
    x = torch.randn(5, 256, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    ref_x = x.detach().clone().requires_grad_(True)
    F.linear(ref_x, layer.weight, layer.bias).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)


def test_other_dtypes_run_on_aten(monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a))
    x, w = torch.randn(2, 256, dtype=torch.bfloat16), torch.randn(BIG, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert calls == []


def _count_calls(monkeypatch, op: str) -> list[tuple]:
    """The argument tuples of every call to `torch.ops.mkldnn.<op>` from now on (the op still runs)."""
    calls: list[tuple] = []
    real = getattr(torch.ops.mkldnn, op)

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, op, spy)
    return calls


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_float32_inference_runs_on_onednn(monkeypatch, one_thread):
    calls = _count_calls(monkeypatch, "_linear_pointwise")
    with torch.inference_mode():
        linear(torch.randn(rowdot.linear_max_rows() + 1, 256), torch.randn(BIG, 256))
        assert len(calls) == 1
        linear(torch.randn(rowdot.linear_max_rows() + 1, 256), torch.randn(BIG - 1, 256))   # small: MKL
        assert len(calls) == 1
        linear(torch.randn(rowdot.linear_max_rows(), 256), torch.randn(BIG, 256))
        assert len(calls) == (1 if rowdot.kernel() else 2)             # a few rows: the rowdot kernel


PACKED = gemm.BACKEND == "onednn-packed"


@pytest.mark.skipif(not PACKED, reason="float linears do not run on packed oneDNN weights here")
def test_packed_weights_give_the_row_major_product_and_rows_their_rows_in_a_batch(one_thread):
    gen = torch.Generator().manual_seed(1)
    low = rowdot.linear_max_rows() + 1 if rowdot.kernel() else 1      # fewer rows run on the rowdot kernels
    w, x = torch.randn(2 * BIG, 256, generator=gen), torch.randn(low + 16, 256, generator=gen)
    row_major = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        batch = linear(x, w)
        for rows in sorted({max(low, 2), low + 7, low + 16}):   # bitwise the product on the weight as stored
            assert torch.equal(linear(x[:rows], w), row_major(x[:rows], w, None, "none", [], ""))
        for i in (0, 5, 16):                                 # batch-invariant: a row's value is its row's
            assert torch.equal(linear(x[i:i + low], w), batch[i:i + low])


@pytest.mark.parametrize("copy", ["onednn-packed", "panels"])
def test_a_weight_copy_is_made_once_remade_when_written_and_forgotten_when_freed(monkeypatch, one_thread, copy):
    """oneDNN's packed copy (more rows than the kernels take) and the panel kernel's copy (2-16 rows)."""
    if copy == "onednn-packed" and not PACKED:
        pytest.skip("float linears do not run on packed oneDNN weights here")
    if copy == "panels" and not (rowdot.kernel() and rowdot.PANELS):
        pytest.skip("the rowdot panel kernel does not run here")
    if copy == "onednn-packed":
        packs, cache = _count_calls(monkeypatch, "_reorder_linear_weight"), gemm._PACKED
        rows = rowdot.linear_max_rows() + 1
    else:
        packs, cache, rows = [], gemm._PANELS, 4
        real = rowdot.Kernel.pack
        monkeypatch.setattr(rowdot.Kernel, "pack", lambda self, w: packs.append(w) or real(self, w))
    layer = Linear(256, BIG)
    x = torch.randn(rows, 256)
    kept = gemm.kept_copies()                               # what a benchmark's warm-up watches
    with torch.no_grad():
        for _ in range(3):
            before = layer(x)
        assert len(packs) == 1 and gemm.kept_copies() == kept + 1
        layer.weight.mul_(2.0)                              # an in-place load bumps the version: a new copy
        after = layer(x)
    assert len(packs) == 2 and gemm.kept_copies() == kept + 1       # made again in place of the old one
    torch.testing.assert_close(after, F.linear(x, layer.weight.detach(), layer.bias.detach()), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(after, before)
    held = len(cache)
    del layer
    gc.collect()
    assert len(cache) == held - 1 and gemm.kept_copies() == kept


def _backend_in_child(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, gemm.BACKEND_ENV: value, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", "from engine.model import gemm; print(gemm.BACKEND)"],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["aten", "onednn"] + (["onednn-packed"] if ONEDNN else []))
def test_the_operator_chooses_the_backend(value):
    done = _backend_in_child(value)
    assert done.returncode == 0 and done.stdout.strip() == value


def test_an_unknown_backend_stops_start_up():
    done = _backend_in_child("cublas")
    assert done.returncode != 0 and "KIMI_PD_CPU_GEMM='cublas'" in done.stderr
