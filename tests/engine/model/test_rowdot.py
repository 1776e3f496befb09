"""engine/model/rowdot.py: both kernels (row-major, panels) and the grouped calls agree with F.linear, sum a
row the same way whatever rows are beside it, are what `gemm.linear` runs up to sixteen rows on, and step
aside cleanly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model import gemm, rowdot

ROOT = Path(__file__).resolve().parents[3]
KERNEL = rowdot.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the rowdot kernel does not run here (no cc or AVX2)")


@needs_kernel
@pytest.mark.parametrize("n", [16, 31, 32, 48, 83, 1024])
@pytest.mark.parametrize("out", [1, 5, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear(n, out, rows, bias):
    """Widths with and without a 32-float body, a 16-float chunk and a scalar tail; odd row counts."""
    gen = torch.Generator().manual_seed(n * 1000 + out * 10 + rows)
    x, w = torch.randn(rows, n, generator=gen), torch.randn(out, n, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    torch.testing.assert_close(KERNEL(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * n ** 0.5)


@needs_kernel
def test_a_row_is_bitwise_the_same_alone_and_beside_others():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 1000, generator=gen), torch.randn(40, 1000, generator=gen)
    together = KERNEL(x, w)
    for i in range(5):
        assert torch.equal(KERNEL(x[i:i + 1], w), together[i:i + 1])
    assert torch.equal(KERNEL(x[1:3], w), together[1:3])


@needs_kernel
def test_grouped_products_are_bitwise_one_call_per_group():
    """One call for a MoE layer's chosen experts: each group as its own call computes it; a group over
    `max_rows` is left to the caller (the rows around it are still right)."""
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(48, 83, generator=gen) for _ in range(5)]
    counts = [2, 0, 1, 4, 3]
    x = torch.randn(sum(counts), 83, generator=gen)
    got = KERNEL.grouped(x, weights, counts, max_rows=3)
    pos = 0
    for w, n in zip(weights, counts, strict=True):
        if 0 < n <= 3:
            assert torch.equal(got[pos:pos + n], KERNEL(x[pos:pos + n], w))
        pos += n
    assert torch.equal(KERNEL.grouped(x, weights, counts)[3:7], KERNEL(x[3:7], weights[3]))   # no limit: all
    row = x[:1]
    same = KERNEL.same_row(row, weights)
    assert all(torch.equal(same[g:g + 1], KERNEL(row, w)) for g, w in enumerate(weights))


@needs_kernel
@pytest.mark.parametrize("n", [1, 17, 1000])
@pytest.mark.parametrize("out", [1, 32, 33, 100])
@pytest.mark.parametrize("rows", [1, 5, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_matches_f_linear(n, out, rows, bias):
    """Outputs that fill panels exactly, leave a partial last panel, or fit in one; one pass of up to eight
    rows, and more passes over the same panel."""
    gen = torch.Generator().manual_seed(n * 1000 + out * 10 + rows)
    x, w = torch.randn(rows, n, generator=gen), torch.randn(out, n, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    got = KERNEL.panels(x, KERNEL.pack(w), out, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * n ** 0.5)


@needs_kernel
def test_a_panel_row_is_bitwise_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(17, 300, generator=gen), torch.randn(70, 300, generator=gen), torch.randn(70, generator=gen)
    packed = KERNEL.pack(w)
    together = KERNEL.panels(x, packed, 70, b)
    for lo, hi in [(0, 1), (3, 4), (2, 5), (1, 9), (8, 16), (16, 17)]:
        assert torch.equal(KERNEL.panels(x[lo:hi], packed, 70, b), together[lo:hi])


def _spy(monkeypatch, name: str, calls: list) -> None:
    real = getattr(rowdot.Kernel, name)

    def spy(self, x, *rest):
        calls.append((name, tuple(x.shape)))
        return real(self, x, *rest)

    monkeypatch.setattr(rowdot.Kernel, name, spy)


@needs_kernel
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "panels-off"])
def test_linear_runs_up_to_sixteen_rows_on_the_kernels_and_more_elsewhere(monkeypatch, one_thread, panels):
    """In a forward on one thread (the engine's small forwards): one row on the row-major kernel, 2-16 on the
    panels (with the panels off: 1-3 rows on the row-major kernel); a threaded forward keeps oneDNN's."""
    monkeypatch.setattr(rowdot, "PANELS", panels)
    calls: list[tuple[str, tuple[int, ...]]] = []
    _spy(monkeypatch, "__call__", calls)
    _spy(monkeypatch, "panels", calls)
    big = gemm.ONEDNN_MIN_WEIGHT_ELEMENTS // 256
    w, b = torch.randn(big, 256), torch.randn(big)
    most = rowdot.linear_max_rows()
    many = "panels" if panels else "__call__"
    with torch.inference_mode():
        for shape in [(256,), (1, 256), (2, 256), (most, 256), (1, most, 256), (most + 1, 256), (32, 256)]:
            x = torch.randn(*shape)
            got = gemm.linear(x, w, b)
            assert got.shape == (*shape[:-1], big)
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        gemm.linear(torch.randn(1, 256), torch.randn(big - 1, 256))      # a small weight: aten's
        gemm.linear(torch.randn(2, 512)[:, ::2], w)                      # a strided input, copied for the kernel
    assert calls == [("__call__", (1, 256)), ("__call__", (1, 256)), (many, (2, 256)), (many, (most, 256)),
                     (many, (most, 256)), (many, (2, 256))]
    torch.set_num_threads(2)
    with torch.inference_mode():
        x = torch.randn(2, 256)
        torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert len(calls) == 6
    x = torch.randn(1, 256, requires_grad=True)                         # autograd needs aten's product
    gemm.linear(x, w).sum().backward()
    assert x.grad is not None and len(calls) == 6


def _in_child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120)


CHILD = """
import logging, torch, torch.nn.functional as F
logging.basicConfig(level=logging.INFO)
from engine.model import gemm, rowdot
w, x = torch.randn(1024, 256), torch.randn(1, 256)
with torch.inference_mode():
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
print("kernel", rowdot.kernel() is not None)
"""


def test_the_operator_can_turn_it_off():
    done = _in_child(CHILD, **{rowdot.ENABLE_ENV: "0"})
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout and "rowdot kernel off" in done.stderr


def test_without_a_compiler_the_linears_stay_where_they_were(tmp_path):
    done = _in_child(CHILD, CC=str(tmp_path / "no-such-cc"), **{rowdot.CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout
    assert "rowdot kernel unavailable" in done.stderr and "no C compiler" in done.stderr


@needs_kernel
def test_the_library_is_built_once_per_source_and_compiler(tmp_path):
    first = rowdot.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert rowdot.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]          # no temporary file left behind


@needs_kernel
def test_a_host_without_a_compiler_loads_a_library_built_beforehand(tmp_path):
    """What the CPU image does: build while gcc is there, run without it."""
    rowdot.build(tmp_path)
    done = _in_child(CHILD, CC=str(tmp_path / "no-such-cc"), **{rowdot.CACHE_ENV: str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "kernel True" in done.stdout


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@needs_kernel
def test_the_code_that_runs_is_the_widest_this_cpu_has():
    flags = _cpu_flags()
    assert KERNEL.width == (512 if {"avx512f", "fma"} <= flags else 256)
    assert KERNEL.width == 512 or {"avx2", "fma"} <= flags


_PRODUCTS = """
import sys, torch
from engine.model import rowdot
k = rowdot.kernel()
gen = torch.Generator().manual_seed(11)
out = {"width": torch.tensor(k.width)}
for n in (16, 83, 1000, 1024):
    w, b = torch.randn(70, n, generator=gen), torch.randn(70, generator=gen)
    packed = k.pack(w)
    for rows in (1, 2, 3, 5, 8, 11, 16):
        x = torch.randn(rows, n, generator=gen)
        out[f"rowdot-{n}-{rows}"] = k(x, w, b)
        out[f"panels-{n}-{rows}"] = k.panels(x, packed, 70, b)
torch.save(out, sys.argv[1])
"""


@needs_kernel
@pytest.mark.skipif(KERNEL is None or KERNEL.width != 512, reason="needs an AVX-512 host to run both codes")
def test_the_avx2_code_gives_the_avx512_bits(tmp_path):
    """`KIMI_PD_ROWDOT_ISA=avx2` runs the AVX2 code on this AVX-512 host: every product, row-major and
    panels, at every row count, must be bitwise what the AVX-512 code gives."""
    got = {}
    for isa in ("default", "avx2"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("KIMI_PD_ROWDOT_ISA", None)
        if isa == "avx2":
            env["KIMI_PD_ROWDOT_ISA"] = "avx2"
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", _PRODUCTS, str(path)], env=env, check=True, timeout=300)
        got[isa] = torch.load(path)
    assert int(got["default"].pop("width")) == 512 and int(got["avx2"].pop("width")) == 256
    for key, value in got["default"].items():
        assert torch.equal(value, got["avx2"][key]), key
