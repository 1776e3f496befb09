"""Linears that read the same input, run as one GEMM (vLLM's merged / QKV-parallel linears, done after load).

A decode step is a chain of GEMVs; every separate linear pays a call, a thread fork/join and a
short, poorly amortised pass over its weight. `fuse_linears` concatenates the weights of linears
reading one input into one matrix, once, after the checkpoint is loaded (and, under TP, after it is
sharded, so each rank fuses its own shards). The checkpoint format and module paths are untouched:
each original parameter becomes a view of its rows of the fused tensor, so `state_dict`, the
benchmarks' byte counts and an in-place `load_state_dict` see (and write) the same storage, and the
fused tensor itself is held outside the module tree (never counted or moved twice).

Quantized linears fuse in their packed form: W8A8 int8 rows and W4A8 packed bytes (two rows per
byte; every member has an even row count, so no byte is split) are concatenated with their
`weight_scale`/`weight_offset`/`scale_bias` rows. The per-token activation scale depends only on the
shared input and the int32 product is exact, so a fused quantized linear is bit-identical to its
members. Linears of different kinds (W8A8 vs W4A8, other dtypes) fuse by kind: a mixed set becomes
one GEMM per kind, except that the float linears of a set holding quantized ones keep their own
GEMMs, so a quantized model fused is bit-identical to unfused. Anything else (row-parallel wrappers,
biased or unknown modules) is left alone.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.model.gemm import Linear, linear, uses_onednn
from engine.model.quant import W4A8DynamicLinear, W8A8DynamicLinear

FUSED_ATTR = "_fused_projections"
EXPERT_GEMMS_ATTR = "_expert_gemms"        # a latent MoE's fused float experts, called directly
# A fused float GEMM runs for inputs of at most this many rows (decode steps of small batches, the
# routed experts' few tokens); wider inputs run the members' GEMMs on their views. Measured on this
# 2-core CPU (fp32): on MKL's sgemm, fused q|k|v|f_a|b|g and router|down|shared gate|up are 13-20 %
# faster than separate GEMMs at 1-3 rows but up to 1.7x slower at 8 (its small-M kernel on a
# ~2100-column matrix); on oneDNN (engine/model/gemm.py) the fused GEMM was as fast or faster at every
# row count tried (1-1024), so it always runs there (`fused_gemm_max_rows`). Quantized sets always
# fuse (exact; activations are quantized once).
FUSED_GEMM_MAX_ROWS = 3


def fused_gemm_max_rows(weight: torch.Tensor) -> int:
    """Rows up to which a fused float GEMM on `weight` beats its members' (any count on oneDNN)."""
    return 1 << 62 if uses_onednn(weight) else FUSED_GEMM_MAX_ROWS


def _kind(module: nn.Module) -> tuple | None:
    """Which linears can share one GEMM: same class, dtype (and W4A8 scale_bias columns)."""
    if isinstance(module, nn.Linear) and module.bias is None:
        return ("float", module.weight.dtype, module.weight.device)
    if isinstance(module, W4A8DynamicLinear):
        return ("w4a8", module.params_dtype, module.scale_bias.shape[1], module.weight.device)
    if isinstance(module, W8A8DynamicLinear):
        return ("w8a8", module.params_dtype, module.weight.device)
    if type(module).__name__ == "Router":            # x @ W.T, like a float linear when dtypes agree
        return ("float", module.weight.dtype, module.weight.device)
    return None


def _out_features(module: nn.Module) -> int:
    return module.weight_scale.shape[0] if hasattr(module, "weight_scale") else module.weight.shape[0]


def _rebind(member: nn.Module, name: str, fused: torch.Tensor) -> None:
    """Point `member.name` at `fused` (a view of the merged storage), keeping the Parameter object."""
    param = getattr(member, name)
    if tuple(param.shape) != tuple(fused.shape):
        raise AssertionError(f"fused view {tuple(fused.shape)} != {name} {tuple(param.shape)}")
    param.data = fused


def _merge(members: list[nn.Module]) -> nn.Module:
    """One linear whose output rows are the members' rows in order; members become views of it."""
    first, sizes = members[0], [_out_features(m) for m in members]
    total, in_features = sum(sizes), first.weight.shape[1]
    with torch.no_grad():
        if isinstance(first, W8A8DynamicLinear | W4A8DynamicLinear):
            if isinstance(first, W4A8DynamicLinear):
                merged = W4A8DynamicLinear(in_features, total, first.scale_bias.shape[1], device="meta",
                                           params_dtype=first.params_dtype)
                names = ("weight", "weight_scale", "weight_offset", "scale_bias")
            else:
                merged = W8A8DynamicLinear(in_features, total, device="meta", params_dtype=first.params_dtype)
                names = ("weight", "weight_scale", "weight_offset")
            for name in names:
                setattr(merged, name, nn.Parameter(torch.cat([getattr(m, name) for m in members]),
                                                   requires_grad=False))
        else:
            merged = Linear(in_features, total, bias=False, device="meta")
            merged.weight = nn.Parameter(torch.cat([m.weight for m in members]), requires_grad=False)
        lo = 0
        for member, size in zip(members, sizes, strict=False):
            packed = 2 if isinstance(member, W4A8DynamicLinear) else 1     # W4A8: two rows per byte
            _rebind(member, "weight", merged.weight[lo // packed:(lo + size) // packed])
            for name in ("weight_scale", "weight_offset", "scale_bias"):
                if hasattr(member, name):
                    _rebind(member, name, getattr(merged, name)[lo:lo + size])
            lo += size
    return merged


class FusedProjections:
    """The outputs of several linears of one input, as `chunks` (runs of consecutive members).

    A chunk whose members share one kind is a column slice of one GEMM's output (a view, no copy);
    a chunk mixing kinds is concatenated. Not an nn.Module on purpose: the merged tensors are views'
    storage, registered through the members only.
    """

    def __init__(self, members: Sequence[nn.Module], chunks: Sequence[int]) -> None:
        kinds = [_kind(m) for m in members]
        if any(k is None for k in kinds):
            raise TypeError("only plain, W8A8 and W4A8 linears (and the MoE router) can be fused")
        if any(k[0] != "float" for k in kinds):
            # A quantized set fuses its quantized linears only (bit-exact); its float linears keep their
            # own GEMMs: a float GEMM of another shape rounds differently, and an activation quantized
            # downstream can turn that last-bit difference into a whole int8 step.
            kinds = [k if k[0] != "float" else ("alone", i) for i, k in enumerate(kinds)]
        if sum(chunks) != len(members):
            raise ValueError(f"chunks {tuple(chunks)} do not cover {len(members)} linears")
        order = list(dict.fromkeys(kinds))
        self.groups: list[nn.Module] = []
        merged_float = False
        max_rows = 1 << 62                  # the least any merged float GEMM allows (fused_gemm_max_rows)
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(members)     # (group, lo, hi) per member
        for g, kind in enumerate(order):
            group = [i for i, k in enumerate(kinds) if k == kind]
            lo = 0
            for i in group:
                size = _out_features(members[i])
                where[i] = (g, lo, lo + size)
                lo += size
            self.groups.append(_merge([members[i] for i in group]) if len(group) > 1 else members[group[0]])
            if len(group) > 1 and kind[0] == "float":
                merged_float = True
                max_rows = min(max_rows, fused_gemm_max_rows(self.groups[-1].weight))
        self.chunks: list[tuple[int, int, int] | list[tuple[int, int, int]]] = []
        start = 0
        for n in chunks:
            spans = where[start:start + n]
            contiguous = all(s[0] == spans[0][0] for s in spans) and all(
                a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
            self.chunks.append((spans[0][0], spans[0][1], spans[-1][2]) if contiguous else spans)
            start += n
        # our Linear's product is `linear` on its weight: called directly (no module call); any other
        # module (a plain nn.Linear member keeps aten's GEMM) through itself, as unfused
        self._float = [isinstance(g, Linear) for g in self.groups]
        self._member_list, self._chunk_sizes = list(members), list(chunks)
        self._merged_float = merged_float
        self._max_rows = max_rows
        # One GEMM whose chunks tile its columns in order: one `split` makes every chunk's view.
        tiles = len(self.groups) == 1 and all(isinstance(c, tuple) for c in self.chunks) and all(
            a[2] == b[1] for a, b in zip(self.chunks, self.chunks[1:], strict=False)) and self.chunks[0][1] == 0
        self._split_sizes = [hi - lo for _, lo, hi in self.chunks] if tiles else None

    def _members(self, x: torch.Tensor) -> list[torch.Tensor]:
        return _one_by_one(self._member_list, x, self._chunk_sizes)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.shape[0] > self._max_rows and self._merged_float:
            return self._members(x)
        outs = [linear(x, g.weight) if is_float else _apply(g, x)
                for g, is_float in zip(self.groups, self._float, strict=False)]
        if self._split_sizes is not None:
            return list(outs[0].split(self._split_sizes, dim=-1))
        result = []
        for chunk in self.chunks:
            if isinstance(chunk, tuple):
                g, lo, hi = chunk
                result.append(outs[g][..., lo:hi])
            else:
                result.append(torch.cat([outs[g][..., lo:hi] for g, lo, hi in chunk], dim=-1))
        return result


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.logits(x) if type(module).__name__ == "Router" else module(x)


def project(owner: nn.Module, x: torch.Tensor, members: Sequence[nn.Module],
            chunks: Sequence[int]) -> list[torch.Tensor]:
    """The chunked outputs of `members` on x: fused if `fuse_linears(owner, ...)` ran, else one by one."""
    fused = owner.__dict__.get(FUSED_ATTR)
    if fused is not None:
        return fused(x)
    return _one_by_one(members, x, chunks)


def _one_by_one(members: Sequence[nn.Module], x: torch.Tensor, chunks: Sequence[int]) -> list[torch.Tensor]:
    outs = [_apply(m, x) for m in members]
    result, start = [], 0
    for n in chunks:
        result.append(outs[start] if n == 1 else torch.cat(outs[start:start + n], dim=-1))
        start += n
    return result


def fuse_linears(owner: nn.Module, members: Sequence[nn.Module], chunks: Sequence[int]) -> bool:
    """Fuse `members` (all reading one input) for `project(owner, ...)`; False (left alone) if any
    member cannot be fused or there is nothing to gain (a single member)."""
    if owner.__dict__.get(FUSED_ATTR) is not None:
        return True
    if len(members) < 2 or any(_kind(m) is None for m in members):
        return False
    owner.__dict__[FUSED_ATTR] = FusedProjections(members, chunks)
    return True


def unfuse_linears(owner: nn.Module) -> None:
    """Back to one GEMM per linear (the members keep their views; results are the same)."""
    owner.__dict__.pop(FUSED_ATTR, None)
    owner.__dict__.pop(EXPERT_GEMMS_ATTR, None)


def is_fused(owner: nn.Module) -> bool:
    return owner.__dict__.get(FUSED_ATTR) is not None
