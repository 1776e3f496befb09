"""Float32 linears of 1 to 16 rows on two small hand-written kernels (`rowdot.c`), built at first use.

Why: a decode step is a chain of GEMVs and few-row GEMMs over weights that do not stay in cache, so its
time is the rate at which a linear streams its weight. On this project's AMD host (one thread, weights
out of cache) oneDNN's packed inner product read the small preset's decode weights at 10-18 GB/s, row-major
oneDNN and MKL at 4-22 (OpenBLAS no faster), where a streaming sum of the same tensors reads 20-27 GB/s.

- **One row: the row-major kernel** (`rowdot`, `Kernel.__call__`) reads each weight row once, front to
  back: 18-26 GB/s (90-99 % of the sum, 1.4-2.0x packed oneDNN), and needs no copy of the weight. It re-reads
  a weight row for every pair of input rows, so from three rows on it falls behind.
- **Two to sixteen rows: the panel kernel** (`paneldot`, `Kernel.panels`) reads a copy of the weight laid
  out in panels of 32 outputs (`Kernel.pack`, made once per weight by `gemm.panel_weight`): for each input
  index the 32 weights it meets are contiguous, so a panel streams front to back while each input value
  is broadcast against it, up to eight rows a pass. 20-27 GB/s on two to four rows, 12-22 on eight
  (1.0-2.2x packed oneDNN), about even with it on sixteen, where one core's multiply-adds, not memory,
  are the limit (`python -m benchmarks.linear_rates --rows 1 2 3 4 8 16`). Decode steps of the small
  preset ran 1.11x (batch 2), 1.13x (4), 1.10-1.15x (8) and 1.08x (16) faster than with the row-major
  kernel up to three rows and oneDNN above (in-process A/B, 3 Dec 2026).
- **A MoE layer's chosen experts** take one row-major call per weight kind (`Kernel.grouped`,
  `Kernel.same_row`: every chosen expert's w1|w3, then every w2) for experts of as many rows as
  `linear` would run there (`row_major_max_rows`), each product bitwise what its own call gives
  (batch 1 1.08x, batch 8 1.05x, in-process A/B).

`gemm.linear` uses them in forwards on one thread (the engine runs small forwards on one thread on
small hosts, engine/host_threads.py; a threaded forward keeps oneDNN's threaded product, larger hosts
were not measured), for float32 weights of at least 128K elements.

What it costs: a C compiler on the host at first use (a fraction of a second; the library is cached per
source and compiler in `$KIMI_PD_KERNEL_CACHE`, default `~/.cache/kimi-pd/kernels`; the CPU image builds it
in, deploy/docker/Dockerfile), a CPU with AVX-512F or AVX2 with FMA, and the panel copy of every large
weight that a forward of 2-16 rows meets (as oneDNN's packed copy is kept for the larger ones: up to three
copies of a weight in all). Each kernel is compiled for AVX-512 and for AVX2 and runs the first where the
CPU has it (`Kernel.width`: 512 or 256); the AVX2 code makes the same multiply-adds lane for lane and
reduces in the same order, so both give the same bits. On an AVX2 host (2-core AMD EPYC, 5 Dec 2026) one row
read 16-21 GB/s against packed oneDNN's 11-18, and the panels 1.2-1.75x oneDNN's rate at 2-16 rows
(`benchmarks/results/linear_rates_avx2.json`); a decode step of the small preset ran 1.91x (batch 1) and
1.95x (batch 8) faster than with the kernels off (`benchmarks/results/engine_throughput.md`). Without a
compiler or either ISA, or with `KIMI_PD_CPU_ROWDOT=0`, the linears stay on oneDNN/MKL as before and one log
line says why; `KIMI_PD_CPU_PANELS=0` keeps the row-major kernel for one to three rows and oneDNN above (the
engine before the panels). Rounding: the row-major kernel sums every dot in one order, so a row alone is
bitwise that row beside one or two others; the panel kernel sums every output as one multiply-add chain, so
any of its rows is bitwise the same in a batch of 2 to 16 (or more); the two kernels and oneDNN differ from
each other in rounding only.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.host_threads import switched_off

log = logging.getLogger(__name__)

ENABLE_ENV = "KIMI_PD_CPU_ROWDOT"
PANELS_ENV = "KIMI_PD_CPU_PANELS"      # 0: 1-3 rows on the row-major kernel, more on oneDNN (before the panels)
CACHE_ENV = "KIMI_PD_KERNEL_CACHE"
SOURCE = Path(__file__).with_name("rowdot.c")
# -fno-trapping-math: no code here reads floating-point exception flags, and it lets decode_ops.c's
# exp/tanh loops vectorise (values are IEEE either way; no reassociation)
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-fno-trapping-math")
LDLIBS = ("-lm",)                  # decode_ops.c calls expf/sqrtf
COMPILE_TIMEOUT_S = 120.0
PANEL_MAX_ROWS = 16                 # rows `linear` sends to the panels: 2-8 gain, 16 about even with packed oneDNN
ROW_MAJOR_MAX_ROWS = 3              # without the panels: rows on the row-major kernel (1-3 gain, eight lose 2x)
PANELS = not switched_off(os.environ, PANELS_ENV)


def row_major_max_rows() -> int:
    """Rows `gemm.linear` (and a MoE expert's group) run on the row-major kernel."""
    return 1 if PANELS else ROW_MAJOR_MAX_ROWS


def linear_max_rows() -> int:
    """Rows `gemm.linear` sends to either kernel; more go to oneDNN."""
    return PANEL_MAX_ROWS if PANELS else ROW_MAJOR_MAX_ROWS


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kimi-pd" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def build(out_dir: Path | None = None, source: Path = SOURCE, extra: tuple[Path, ...] = ()) -> Path:
    """The shared library of `source` (this kernel's by default; engine/model/decode_ops.c too, with this
    kernel's source as `extra`: sources compiled into the same library), compiled unless one for these
    sources and compiler is cached. Written under a temporary name and renamed, so
    processes building at once never load a half-written file. A host without a compiler takes a library
    built for this source by any compiler (an image builds it while it has gcc and drops gcc after:
    deploy/docker/Dockerfile)."""
    out_dir = out_dir or cache_dir()
    stem = source.stem
    digest = _digest(source.read_text(), *(e.read_text() for e in extra), *CFLAGS, *LDLIBS)
    cc = _compiler()
    if cc is None:
        built = sorted(out_dir.glob(f"{stem}-{digest}-*.so"))
        if built:
            return built[0]
        raise RuntimeError(f"no C compiler (set CC or install gcc) and no library built for this source in {out_dir}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    lib = out_dir / f"{stem}-{digest}-{_digest(version)}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source), *map(str, extra), *LDLIBS], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class Kernel:
    """The loaded library: `rowdot(x, weight, bias)` for 2-D contiguous float32 CPU tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.rowdot_supported.restype = ctypes.c_int
        fn = self._lib.rowdot
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        self._fn = fn
        jobs = self._lib.rowdot_jobs
        jobs.restype = None
        jobs.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2
        self._jobs = jobs
        self._lib.panel_pack.restype = None
        self._lib.panel_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        self._lib.paneldot.restype = None
        self._lib.paneldot.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        self._lib.panel_width.restype = ctypes.c_long
        self.panel = int(self._lib.panel_width())          # outputs per panel, as rowdot.c lays them out
        self._lib.rowdot_width.restype = ctypes.c_int
        self.width = int(self._lib.rowdot_width())         # 512 (AVX-512) or 256 (AVX2): the code that runs here

    def supported(self) -> bool:
        return bool(self._lib.rowdot_supported())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, n = x.shape
        out = weight.shape[0]
        y = torch.empty(rows, out, dtype=torch.float32)
        self._fn(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                 out, n, rows)
        return y

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [out, n] (contiguous float32) in the panel layout `panels` reads: a new tensor, the
        outputs padded to a whole panel."""
        out, n = weight.shape
        packed = torch.empty(-(-out // self.panel) * self.panel * n, dtype=torch.float32)
        self._lib.panel_pack(weight.data_ptr(), packed.data_ptr(), out, n)
        return packed

    def panels(self, x: torch.Tensor, packed: torch.Tensor, out: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [rows, n] times the weight `pack` laid out (`out` outputs): y [rows, out]."""
        rows, n = x.shape
        y = torch.empty(rows, out, dtype=torch.float32)
        self._lib.paneldot(packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                           out, n, rows)
        return y

    def grouped(self, x: torch.Tensor, weights: list[torch.Tensor], counts: list[int],
                max_rows: int | None = None) -> torch.Tensor:
        """Consecutive row groups of `x` [R, n] (contiguous float32), `counts[g]` rows each, through
        `weights[g]` (all [out, n], contiguous): y [R, out] in one call, each group bitwise `self(x_g, w_g)`.
        Groups of more than `max_rows` rows are left unwritten (the caller computes them elsewhere)."""
        return self._run(x, weights, counts, x.shape[1] * x.element_size(), max_rows)

    def same_row(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """One row `x` [1, n] through each weight: y [len(weights), out], row g bitwise `self(x, weights[g])`."""
        return self._run(x, weights, [1] * len(weights), 0, None)

    def _run(self, x: torch.Tensor, weights: list[torch.Tensor], counts: list[int], x_step: int,
             max_rows: int | None) -> torch.Tensor:
        width, n = weights[0].shape
        y = torch.empty(sum(counts), width, dtype=torch.float32)
        ws, xs, ys, rows, pos = [], [], [], [], 0
        x0, y0, y_step = x.data_ptr(), y.data_ptr(), width * y.element_size()
        for w, c in zip(weights, counts, strict=True):
            if c and (max_rows is None or c <= max_rows):
                ws.append(w.data_ptr())
                xs.append(x0 + pos * x_step)
                ys.append(y0 + pos * y_step)
                rows.append(c)
            pos += c
        if ws:
            array = ctypes.c_long * len(ws)
            self._jobs(len(ws), array(*ws), array(*xs), array(*ys), array(*rows), width, n)
        return y


def _agrees(kernel: Kernel) -> bool:
    """Each entry (row-major, grouped, panels) matches F.linear on a product with a ragged width and a
    bias (a wrong build or ABI would show here, before any model output depends on it)."""
    gen = torch.Generator().manual_seed(0)
    w, x, b = (torch.randn(37, 83, generator=gen), torch.randn(2, 83, generator=gen),
               torch.randn(37, generator=gen))
    w2 = torch.randn(37, 83, generator=gen)
    checks = [(kernel(x, w, b), F.linear(x, w, b)),
              (kernel.grouped(x, [w, w2], [1, 1]), torch.cat([F.linear(x[:1], w), F.linear(x[1:], w2)])),
              (kernel.panels(x, kernel.pack(w), w.shape[0], b), F.linear(x, w, b))]   # 37: a partial panel
    return all(torch.allclose(got, want, rtol=1e-5, atol=1e-5) for got, want in checks)


@functools.cache
def kernel() -> Kernel | None:
    """The kernel, built and checked once per process; None (and one log line) where it cannot run."""
    if switched_off(os.environ, ENABLE_ENV):
        log.info("rowdot kernel off (%s=0): linears of one to sixteen rows stay on oneDNN/MKL", ENABLE_ENV)
        return None
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        log.info("rowdot kernel not built: it is written for x86-64 Linux (this is %s %s)",
                 platform.system(), platform.machine())
        return None
    try:
        k = Kernel(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("rowdot kernel unavailable, linears of one to sixteen rows stay on oneDNN/MKL: %s", exc)
        return None
    if not k.supported():
        log.info("rowdot kernel not used: this CPU has neither AVX-512F nor AVX2 with FMA")
        return None
    if not _agrees(k):
        log.warning("rowdot kernel disagrees with F.linear on its check product; not used")
        return None
    return k


if __name__ == "__main__":    # `python -m engine.model.rowdot DIR`: build both C libraries into DIR (an image's step)
    import sys
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    print(build(target))
    print(build(target, SOURCE.with_name("decode_ops.c"), (SOURCE,)))
