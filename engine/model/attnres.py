"""Block Attention Residuals (MODEL.md section 5): a softmax over depth, per token, in fp32."""
from __future__ import annotations

import torch
from engine.model.layers import upcast
from torch import nn


def attn_res(sources: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """Mix `sources` (completed blocks then the partial sum, each [T, D]) for every token.

    Keys are the sources RMS-normalised WITHOUT weight; the pseudo-query is norm.w * proj.w; the
    output is the softmax-weighted sum of the UN-normalised sources, cast to the sources' dtype.
    """
    v = upcast(torch.stack(sources, dim=1))                                   # [T, n, D]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = upcast(norm_weight) * upcast(proj_weight).view(-1)
    probs = torch.softmax(keys @ query, dim=-1)                                # [T, n]
    return (probs[:, None, :] @ v).squeeze(1).to(sources[-1].dtype)


class AttnResWeights(nn.Module):
    """The two learned vectors of one AttnRes site, named like the checkpoint (`*_res_norm`, `*_res_proj`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dim))
        self.proj = nn.Linear(dim, 1, bias=False)
