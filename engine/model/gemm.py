"""The float linears of the CPU engine, on oneDNN's inner product rather than MKL's sgemm.

Why: a decode step is a chain of GEMVs and small-M GEMMs over weights that do not stay in cache,
and prefill is a chain of GEMMs. On this project's AMD (Zen 4) CPU host, MKL's sgemm read such a
weight at about half oneDNN's rate (2080x1024 fp32, 60 different weights in turn: one row ~16 vs
~32 GB/s, eight rows ~13 vs ~26 GB/s) and ran 256-1024-row GEMMs 2.0-2.3x slower
(benchmarks/results/engine_throughput.md). torch's CPU wheel carries oneDNN anyway, and
`torch.ops.mkldnn._linear_pointwise` takes the plain weight: nothing is repacked or copied.

`linear(x, weight, bias)` is `F.linear` with that choice made per call: oneDNN for float32 CPU
tensors outside autograd with a row-major weight (oneDNN rejects a transposed view) of at least
128K elements, aten (`F.linear`) for anything else: small weights (MKL's call costs less), other
devices and dtypes, training, a torch built without oneDNN.
The two differ only in rounding (float32 sums in another order).

oneDNN reads a weight faster in its own blocked layout than row-major: each such weight gets a packed
copy (`torch.ops.mkldnn._reorder_linear_weight`, laid out for 8 rows) the first time it is used and
keeps it while the weight's storage and version are unchanged. On this host one to sixteen rows ran
1.3-1.7x faster (2080x1024 fp32: one row 395 -> 264 us, eight 612 -> 387 us), and a decode step of the
small preset 1.2-1.5x faster at batch 8 (benchmarks/results/engine_throughput.md). The packed product is
bitwise the plain one from two rows up, and batch-invariant: a row's result does not depend on the
rows beside it (with the plain weight one row takes another kernel). The price is a second copy of
every float weight on oneDNN (the row-major one stays: checkpoints, sharding, state dicts read it).
`KIMI_PD_CPU_GEMM` (read once, when this module loads): `onednn-packed` (default), `onednn` (oneDNN on
the row-major weights, no second copy) or `aten` (MKL everywhere).

Up to sixteen rows of such a product, in a forward on one thread, skip all of these for the rowdot
kernels (compiled one-thread kernels that stream the weight at up to twice oneDNN's rate here: one row
on the weight as stored, 2-16 rows on a panel copy of it, `panel_weight`; engine/model/rowdot.py), where
they could be built and run. A forward on more threads keeps oneDNN's threaded product: the engine runs
small forwards on one thread on small hosts (engine/host_threads.py), and larger hosts were not measured.
"""
from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import rowdot

log = logging.getLogger(__name__)

BACKEND_ENV = "KIMI_PD_CPU_GEMM"
BACKENDS = ("onednn-packed", "onednn", "aten")


def _onednn_works(packed: bool) -> bool:
    """True when this torch has oneDNN's linear op (and, if `packed`, its weight packing) and it agrees
    with aten on a small product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 8), torch.arange(32, dtype=torch.float32).reshape(4, 8)
        weights = (w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)) if packed else (w,)
        return all(torch.equal(torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""), F.linear(x, w))
                   for weight in weights)
    except (RuntimeError, AttributeError) as exc:       # op missing or not built for this CPU
        log.warning("oneDNN %s unavailable (%s)", "weight packing" if packed else "linear", exc)
        return False


def _chosen_backend() -> str:
    wanted = os.environ.get(BACKEND_ENV, BACKENDS[0]).strip().lower() or BACKENDS[0]
    if wanted not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: expected one of {', '.join(BACKENDS)}")
    if wanted == "aten":
        return wanted
    if _onednn_works(packed=wanted == "onednn-packed"):
        return wanted
    return "onednn" if wanted == "onednn-packed" and _onednn_works(packed=False) else "aten"


PACK_ROWS = 8                  # the row count oneDNN lays a packed weight out for (1-16 rows all gain)
BACKEND = _chosen_backend()
_ONEDNN = BACKEND != "aten"
PACKED = BACKEND == "onednn-packed"


# oneDNN pays ~10 us more a call than MKL (primitive lookup); it wins from about 256x256 weights and by
# 1.4-1.7x from 1024x256 on (one thread, 1 or 8 rows, weights out of cache; see
# benchmarks/results/engine_throughput.md), so smaller weights (all of tiny-chat's) stay on MKL
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 17


def _large_float_weight(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS)


def uses_onednn(weight: torch.Tensor) -> bool:
    """Whether a float32 product with this weight runs on oneDNN (inside inference, above the rows the
    rowdot kernel takes; see `linear`)."""
    return _ONEDNN and _large_float_weight(weight)


def _rowdot_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.numel() <= rowdot.linear_max_rows() * weight.shape[1] and x.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.dim() == 1
                                  and bias.is_contiguous() and bias.shape[0] == weight.shape[0])))


# id(weight) -> ((storage, version), copy): oneDNN's packed copies, and the rowdot kernel's panel copies
_PACKED: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
_PANELS: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}


def _kept_copy(cache: dict[int, tuple[tuple[int, int], torch.Tensor]], weight: torch.Tensor,
               make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`make(weight)`, made on first use and kept while the weight lives and its storage and version hold
    (an in-place load or `.data` swap remakes it). Kept beside the weight, not on it, so modules still
    pickle and deep-copy as before. Inference tensors have no version counter: one written in place in
    inference mode keeps its copy (the engine never writes weights after loading)."""
    key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
    held = cache.get(id(weight))
    if held is None or held[0] != key:
        if held is None:
            weakref.finalize(weight, cache.pop, id(weight), None)
        held = cache[id(weight)] = (key, make(weight.detach()))
    return held[1]


def kept_copies() -> int:
    """How many weights have a packed or panel copy now: a warmed-up engine makes no more (benchmarks
    warm up until this stops growing, so no timed step pays for a copy)."""
    return len(_PACKED) + len(_PANELS)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` (`_kept_copy`)."""
    return _kept_copy(_PACKED, weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS))


def panel_weight(weight: torch.Tensor, kernel: rowdot.Kernel) -> torch.Tensor:
    """The rowdot kernel's panel copy of `weight` (`_kept_copy`)."""
    return _kept_copy(_PANELS, weight, kernel.pack)


def _float_inference(x: torch.Tensor, weights: tuple[torch.Tensor, ...] | list[torch.Tensor],
                     bias: torch.Tensor | None = None) -> bool:
    """A float32 product outside autograd with weights this module takes (large, row-major, on the CPU)."""
    return (x.dtype == torch.float32 and all(_large_float_weight(w) for w in weights)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)
                                                  or (bias is not None and bias.requires_grad))))


def _one_thread_kernel() -> rowdot.Kernel | None:
    """The rowdot kernels, in a forward on one thread (a threaded one keeps oneDNN's threaded product)."""
    return rowdot.kernel() if torch.get_num_threads() == 1 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: one row on the rowdot kernel, up to `rowdot.PANEL_MAX_ROWS` on its
    panels, more on oneDNN, where those are faster (see the module docstring and engine/model/rowdot.py)."""
    if x.dim() >= 1 and x.shape[-1] == weight.shape[-1] and _float_inference(x, (weight,), bias):
        if _rowdot_fits(x, weight, bias) and (kernel := _one_thread_kernel()) is not None:
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            rows = (kernel.panels(x2, panel_weight(weight, kernel), weight.shape[0], bias)
                    if x2.shape[0] > rowdot.row_major_max_rows() else kernel(x2, weight, bias))
            return rows.reshape(*x.shape[:-1], weight.shape[0])
        if _ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight) if PACKED else weight, bias,
                                                      "none", [], "")
    return F.linear(x, weight, bias)


def row_major_weights(weights: Sequence[torch.Tensor]) -> bool:
    """Whether `linear` takes each of `weights` to the rowdot kernels outside autograd (large float32
    row-major CPU weights; `rowdot_now` says whether it does for a given input)."""
    return all(_large_float_weight(w) for w in weights)


def rowdot_now(x: torch.Tensor) -> bool:
    """Whether `linear` runs float32 rows `x` [R, n] on the rowdot kernels now (R up to
    `rowdot.linear_max_rows()`, with weights that pass `row_major_weights`): on the row-major kernel up to
    `rowdot.row_major_max_rows()` rows, on the panels above."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= rowdot.linear_max_rows() and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and _one_thread_kernel() is not None)


def grouped_kernel(x: torch.Tensor, weights: list[torch.Tensor]) -> rowdot.Kernel | None:
    """The rowdot kernel when `linear` would run each of `weights` on it for a few rows of `x`, else None:
    the MoE dispatch then runs its chosen experts' products in one kernel call (`Kernel.grouped`),
    bitwise what one `linear` call per expert gives."""
    return _one_thread_kernel() if x.device.type == "cpu" and _float_inference(x, weights) else None


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose product is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
