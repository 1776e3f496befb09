"""Sharded linears and the parallel wrappers that put a sharded model's outputs back together.

Quantized linears are sharded in their packed form (never dequantised): a column (output) shard
takes W8A8 int8 rows, or W4A8 packed bytes (two output rows per byte, so a shard starts on an even
row), with their `weight_scale` rows; a row (input) shard takes weight columns, keeps the per-channel
scales whole and takes its 16/N columns of the W4A8 down-type `scale_bias`.

A row-parallel quantized linear stays bit-identical to the unsharded one: the per-token activation
scale is the absmax over the FULL input (an all-reduce MAX of the local absmax), and the ranks' exact
int32 partial products are summed (all-reduce SUM, exact) before the one dequantising multiply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.gemm import Linear
from engine.model.quant import INT8_QMAX, W4A8DynamicLinear, W8A8DynamicLinear, _DynamicLinearBase, _exact_int_matmul
from engine.parallel.comm import TPGroup


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def shard_out(linear: nn.Module, lo: int, hi: int) -> nn.Linear | _DynamicLinearBase:
    """Output rows lo:hi of a float or quantized linear (a column-parallel shard)."""
    if isinstance(linear, nn.Linear):
        dense = Linear(linear.in_features, hi - lo, bias=False, device="meta")
        dense.weight = _param(linear.weight[lo:hi])
        return dense
    new: _DynamicLinearBase
    if isinstance(linear, W4A8DynamicLinear):
        if lo % 2 or hi % 2:
            raise ValueError(f"W4A8 shard rows {lo}:{hi} split a packed byte (two rows per byte)")
        new = W4A8DynamicLinear(linear.in_features, hi - lo, linear.scale_bias.shape[1], device="meta",
                                params_dtype=linear.params_dtype)
        new.weight = _param(linear.weight[lo // 2:hi // 2])
        new.scale_bias = _param(linear.scale_bias[lo:hi])
    elif isinstance(linear, W8A8DynamicLinear):
        new = W8A8DynamicLinear(linear.in_features, hi - lo, device="meta", params_dtype=linear.params_dtype)
        new.weight = _param(linear.weight[lo:hi])
    else:
        raise TypeError(f"cannot shard {type(linear).__name__}")
    new.weight_scale, new.weight_offset = _param(linear.weight_scale[lo:hi]), _param(linear.weight_offset[lo:hi])
    return new


def shard_in(linear: nn.Module, lo: int, hi: int) -> nn.Linear | _DynamicLinearBase:
    """Input columns lo:hi of a float or quantized linear (a row-parallel shard; outputs are partial)."""
    if isinstance(linear, nn.Linear):
        dense = Linear(hi - lo, linear.out_features, bias=False, device="meta")
        dense.weight = _param(linear.weight[:, lo:hi])
        return dense
    new: _DynamicLinearBase
    if isinstance(linear, W4A8DynamicLinear):
        cols = linear.scale_bias.shape[1]
        width = linear.in_features // cols
        if cols > 1 and (lo % width or hi % width):
            raise ValueError(f"W4A8 scale_bias has {cols} input chunks; shard {lo}:{hi} does not align")
        new = W4A8DynamicLinear(hi - lo, linear.out_features, max(1, cols * (hi - lo) // linear.in_features),
                                device="meta", params_dtype=linear.params_dtype)
        new.scale_bias = _param(linear.scale_bias[:, lo // width:hi // width] if cols > 1 else linear.scale_bias)
    elif isinstance(linear, W8A8DynamicLinear):
        new = W8A8DynamicLinear(hi - lo, linear.out_features, device="meta", params_dtype=linear.params_dtype)
    else:
        raise TypeError(f"cannot shard {type(linear).__name__}")
    new.weight = _param(linear.weight[:, lo:hi])
    new.weight_scale, new.weight_offset = _param(linear.weight_scale), _param(linear.weight_offset)
    return new


class RowParallelLinear(nn.Module):
    """A row (input) shard whose output is summed over the ranks: every rank gets the full output."""

    def __init__(self, inner: nn.Linear | _DynamicLinearBase, group: TPGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        if isinstance(inner, _DynamicLinearBase):
            return self._quantized(x, inner)
        return self.group.all_reduce(inner(x))

    def _quantized(self, x: torch.Tensor, inner: _DynamicLinearBase) -> torch.Tensor:
        lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1]).float()
        absmax = self.group.all_reduce(flat.abs().amax(dim=-1, keepdim=True), op="max")
        scale = absmax / INT8_QMAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        x_q = torch.round(flat / safe).clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8)
        acc = self.group.all_reduce(_exact_int_matmul(x_q, inner.int_weight()))
        out = acc.float() * scale * inner.weight_scale.float().reshape(1, -1)
        return out.to(x.dtype).reshape(*lead, -1)


class VocabParallelHead(nn.Module):
    """The LM head's vocabulary rows of this rank; logits are all-gathered along the vocabulary."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.inner(x), dim=-1)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows lo:hi; other ids look up zeros and the all-reduce fills them in (exact)."""

    def __init__(self, full: nn.Embedding, lo: int, hi: int, group: TPGroup) -> None:
        super().__init__()
        self.lo, self.hi, self.group = lo, hi, group
        self.weight = _param(full.weight[lo:hi])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        h = F.embedding(torch.where(mine, ids - self.lo, torch.zeros_like(ids)), self.weight)
        return self.group.all_reduce(h * mine[..., None].to(h.dtype))
