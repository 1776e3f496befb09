"""Deterministic random weights for generated checkpoints.

Scales are chosen so a random model is numerically healthy (unit-ish activations, non-trivial
routing, decays spread over the gate's range), which makes equivalence tests meaningful: a model
whose logits are all ~0 would agree with anything.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# A random deep net is chaotic: with unit-gain layers, fp32 rounding grows ~2-3x per layer (measured
# on `tiny`: 1e-7 input noise -> 3e-5 in the logits). Half-gain projections and soft AttnRes scores
# keep it well-conditioned (<= 5e-6 over 4 seeds) while every mixer still changes the logits.
_HIDDEN_GAIN = 0.5
_RES_PROJ_STD = 0.15


def _init_param(name: str, p: torch.Tensor, gen: torch.Generator, num_heads: dict[str, int]) -> torch.Tensor:
    shape = p.shape
    if name.endswith("A_log"):
        heads = num_heads[name]
        values = torch.zeros(shape, dtype=torch.float32)
        values[:heads] = torch.empty(heads).uniform_(-1.0, 1.5, generator=gen)
        return values
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return torch.empty(shape).uniform_(-0.3, 0.3, generator=gen)
    if "conv1d" in name:
        return torch.randn(shape, generator=gen) * (0.6 / math.sqrt(shape[-1]))
    if name.endswith("_res_proj.weight"):
        return torch.randn(shape, generator=gen) * _RES_PROJ_STD
    if p.dim() == 1:                                    # norm weights
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if "embed_tokens" in name or "pos_emb" in name:
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1] if p.dim() == 2 else math.prod(shape[1:])
    gain = 1.0 if "lm_head" in name else _HIDDEN_GAIN
    return torch.randn(shape, generator=gen) * (gain / math.sqrt(fan_in))


def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from one generator, in sorted-name order, so the result depends only on seed."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = {}
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "A_log") and hasattr(mod, "num_heads"):
            num_heads[f"{mod_name}.A_log"] = mod.num_heads
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            p.copy_(_init_param(name, p, gen, num_heads).to(p.dtype))
