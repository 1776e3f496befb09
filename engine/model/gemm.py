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
The two differ only in rounding (float32 sums in another order); neither is batch-invariant, so
nothing that held before depends on it. `KIMI_PD_CPU_GEMM=aten` keeps MKL everywhere (read once,
when this module loads).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

BACKEND_ENV = "KIMI_PD_CPU_GEMM"
BACKENDS = ("onednn", "aten")


def _onednn_works() -> bool:
    """True when this torch has oneDNN's linear op and it agrees with aten on a small product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 8), torch.arange(32, dtype=torch.float32).reshape(4, 8)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (RuntimeError, AttributeError) as exc:       # op missing or not built for this CPU
        log.warning("oneDNN linear unavailable (%s); float linears run on aten", exc)
        return False


def _chosen_backend() -> str:
    wanted = os.environ.get(BACKEND_ENV, "onednn").strip().lower() or "onednn"
    if wanted not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: expected one of {', '.join(BACKENDS)}")
    return "onednn" if wanted == "onednn" and _onednn_works() else "aten"


BACKEND = _chosen_backend()
_ONEDNN = BACKEND == "onednn"


# oneDNN pays ~10 us more a call than MKL (primitive lookup); it wins from about 256x256 weights and by
# 1.4-1.7x from 1024x256 on (one thread, 1 or 8 rows, weights out of cache; see
# benchmarks/results/engine_throughput.md), so smaller weights (all of tiny-chat's) stay on MKL
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 17


def uses_onednn(weight: torch.Tensor) -> bool:
    """Whether a float32 product with this weight runs on oneDNN (inside inference; see `linear`)."""
    return (_ONEDNN and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on oneDNN where that is faster (see the module docstring)."""
    if (x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] == weight.shape[-1] and uses_onednn(weight)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose product is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
