"""Block Attention Residuals (docs/model.md, Block AttnRes): a softmax over depth, per token, in fp32."""
from __future__ import annotations

import torch
from torch import nn

from engine.model import decode_ops
from engine.model.gemm import Linear
from engine.model.layers import C_NORM_MAX_ELEMENTS, NormWeight, cast, inference_cached, rms_norm, upcast

# Rows up to which the C form runs (decode and verification steps); prefill keeps torch's threaded ops.
C_MAX_ROWS = 256


def attn_res(sources: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
             eps: float, query: torch.Tensor | None = None) -> torch.Tensor:
    """Mix `sources` (completed blocks then the partial sum, each [T, D]) for every token.

    Keys are the sources RMS-normalised WITHOUT weight; the pseudo-query is norm.w * proj.w (pass
    `query`, from `site_query`, to skip recomputing it); the output is the softmax-weighted sum of
    the UN-normalised sources, cast to the sources' dtype. Float32 steps of at most C_MAX_ROWS rows
    run it in one C call (engine/model/decode_ops.py), equal to this form to rounding.
    """
    if query is not None and len(sources[0]) <= C_MAX_ROWS:
        ops = decode_ops.usable(query, *sources)
        if ops is not None and all(s.is_contiguous() for s in sources) and query.is_contiguous():
            return ops.attn_res(sources, query, eps)
    v = upcast(torch.stack(sources, dim=1))                                   # [T, n, D]
    keys = rms_norm(v, None, eps)           # v * rsqrt(mean(v^2) + eps), one call in fp32/fp64
    if query is None:
        query = pseudo_query(proj_weight, norm_weight)
    probs = torch.softmax(keys @ query, dim=-1)                                # [T, n]
    return cast((probs[:, None, :] @ v).squeeze(1), sources[-1].dtype)


def attn_res_norm(sources: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  query: torch.Tensor, out_weight: torch.Tensor, out_eps: float) -> torch.Tensor:
    """`rms_norm(attn_res(...), out_weight, out_eps)`: a layer's mixing and the norm in front of its mixer
    or FFN. Where both would run in C, one call makes both (`decode_ops.c`'s `attn_res_norm_rows`), so
    bitwise the two calls' result with one trip through Python fewer."""
    if len(sources[0]) <= C_MAX_ROWS and sources[0].numel() <= C_NORM_MAX_ELEMENTS:
        ops = decode_ops.layer_usable(query, out_weight, *sources)
        if (ops is not None and query.is_contiguous() and out_weight.is_contiguous()
                and all(s.is_contiguous() for s in sources)):
            return ops.attn_res_norm(sources, query, eps, out_weight, out_eps)
    return rms_norm(attn_res(sources, proj_weight, norm_weight, eps, query), out_weight, out_eps)


def pseudo_query(proj_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    return upcast(norm_weight) * upcast(proj_weight).view(-1)


def site_query(owner: nn.Module, proj: nn.Linear, norm: NormWeight) -> torch.Tensor:
    """One AttnRes site's pseudo-query, kept on `owner` for inference (`inference_cached`; a decode
    step has 2 sites per layer)."""
    pw, nw = proj.weight, norm.weight
    return inference_cached(owner, f"_attn_res_query_{id(proj)}", (pw, nw), lambda: pseudo_query(pw, nw))


class AttnResWeights(nn.Module):
    """The two learned vectors of one AttnRes site, named like the checkpoint (`*_res_norm`, `*_res_proj`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = NormWeight(dim)
        self.proj = Linear(dim, 1, bias=False)
