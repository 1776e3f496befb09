"""Small building blocks shared by the Kimi-K3 layers: RMSNorm, SiTU, l2norm, dense SiTU MLP."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import decode_ops
from engine.model.fused import fuse_linears, project
from engine.model.gemm import Linear

T = TypeVar("T")
_ACCUMULATION_DTYPES = (torch.float32, torch.float64)
# Elements up to which a float32 norm (or SiTU) runs in C, on the calling thread (decode and verification steps;
# a long prefill keeps torch's threaded operators).
C_NORM_MAX_ELEMENTS = 1 << 18


def upcast(x: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype for internal maths: fp32, or fp64 when the input already is (oracle runs).

    An fp32/fp64 input is returned as is without a call (`x.float()` would return x too, after a
    dispatch: a decode step makes ~600 of them)."""
    return x if x.dtype in _ACCUMULATION_DTYPES else x.float()


def inference_cached(owner: nn.Module, name: str, sources: Sequence[torch.Tensor], build: Callable[[], T]) -> T:
    """`build()`, kept on `owner` under `name` for inference: a value derived from weights that a
    decode step would otherwise rebuild every step (concatenated kernels, absorbed MLA weights,
    AttnRes pseudo-queries). Keyed on each source's storage, version and dtype, so a reload, a cast
    or an in-place update rebuilds it; never kept under grad or torch.compile (a traced step reads
    no cache)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return build()
    key = tuple((t.data_ptr(), t._version, t.dtype) for t in sources)
    hit = owner.__dict__.get(name)
    if hit is None or hit[0] != key:
        hit = owner.__dict__[name] = (key, build())
    return hit[1]


def cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`y.to(dtype)`, skipping the call when y already has it (the result is the same tensor)."""
    return y if y.dtype == dtype else y.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * (x_f32 * rsqrt(mean(x_f32^2) + eps))`, cast back to x's dtype (docs/model.md, Shared building blocks).

    For inference in fp32/fp64 with a weight of x's dtype, torch's `rms_norm` is that formula, bitwise
    (test_decode_fast_paths), in one call instead of seven (a decode step makes ~75); float32 inputs of
    at most C_NORM_MAX_ELEMENTS take one C call instead (engine/model/decode_ops.py: ~2 us against
    torch's ~20 on a decode row; the formula to rounding). Training keeps the formula: its backward is
    the one the shipped checkpoint was trained with."""
    if (x.dtype in _ACCUMULATION_DTYPES and (weight is None or weight.dtype == x.dtype)
            and not torch.is_grad_enabled()):
        if x.dtype == torch.float32 and x.numel() <= C_NORM_MAX_ELEMENTS:
            ops = decode_ops.usable(x)
            y = ops.rms_norm(x, weight, eps) if ops is not None else None
            if y is not None:
                return y
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * upcast(weight)
    return cast(y, x.dtype)


class NormWeight(nn.Module):
    """A norm's weight alone (checkpoint key `<norm>.weight`): its user applies `rms_norm` with its own eps."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` over the last dim (fla's l2norm reference)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: a range-limited SwiGLU, computed in fp32 because tanh saturates differently in bf16.

    `beta*tanh(g/beta)*sigmoid(g) * (linear_beta*tanh(u/linear_beta))`; as beta grows it tends to SiLU(g)*u.
    Float32 inference of at most C_NORM_MAX_ELEMENTS runs in one C call (engine/model/decode_ops.py: about
    a third of torch's six operators on a decode row; within 1-2 ulp of them).
    """
    if (gate.dtype == torch.float32 and up.dtype == torch.float32 and gate.numel() <= C_NORM_MAX_ELEMENTS
            and (linear_beta is None or linear_beta > 0) and beta > 0 and not torch.is_grad_enabled()):
        ops = decode_ops.usable(gate, up)
        y = ops.situ(gate, up, beta, linear_beta) if ops is not None else None
        if y is not None:
            return y
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return cast(a * u, gate.dtype)


class SiTUMLP(nn.Module):
    """Dense gated MLP `down(SiTU(gate(x), up(x)))`: layer 0's `mlp` and the MoE `shared_experts`."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float | None) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, (self.gate_proj, self.up_proj), (1, 1))
        return self.down(gate, up)

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The MLP after its input projections (a latent MoE fuses the shared experts' into its own)."""
        return self.down_proj(situ(gate, up, self.beta, self.linear_beta))

    def fuse_linears(self) -> None:
        """gate_proj + up_proj as one GEMM (engine/model/fused.py)."""
        fuse_linears(self, (self.gate_proj, self.up_proj), (1, 1))


class Dequantizable(Protocol):
    """A quantized linear (engine/model/quant.py) that can give back its float weight."""

    def dequantized_weight(self) -> torch.Tensor: ...


def linear_weight(module: nn.Linear | Dequantizable) -> torch.Tensor:
    """The float weight `[out, in]` of a plain or quantized linear (absorbed MLA needs it)."""
    if isinstance(module, nn.Linear):
        return module.weight
    return module.dequantized_weight()
