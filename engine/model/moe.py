"""Latent MoE with a biased sigmoid router and shared experts (MODEL.md section 7)."""
from __future__ import annotations

import torch
from torch import nn

from shared.model_config import TextConfig
from engine.model.layers import RMSNorm, SiTUMLP, situ, upcast


def route(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router, noaux_tc: the bias only picks experts, weights come from the unbiased scores.

    logits: [T, E] fp32. Returns (weights [T, k] fp32, expert ids [T, k] int64).
    """
    scores = torch.sigmoid(upcast(logits))
    ids = torch.topk(scores + upcast(correction_bias), top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return upcast(x) @ upcast(self.weight).t()


class Expert(nn.Module):
    """One routed expert at the latent width: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, intermediate, bias=False)
        self.w3 = nn.Linear(width, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, width, bias=False)


class LatentMoE(nn.Module):
    """Route on the full-width input, run experts at the latent width, norm, project back, add shared."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.top_k, self.renormalize = cfg.num_experts_per_token, cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.beta, self.linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.gate = Router(d, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(latent, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
        self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.shared_experts = (SiTUMLP(d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                       self.beta, self.linear_beta) if cfg.num_shared_experts else None)
        # Expert parallelism (engine/parallel/shard.py): this rank's experts and the sum over ranks.
        self.expert_range: tuple[int, int] | None = None
        self.reduce_routed = None

    def forward(self, x: torch.Tensor, static: bool = False) -> torch.Tensor:
        """static: capture-safe (no host reads of the routing): every local expert runs on every token
        and a dense routing-weight mask keeps the chosen ones (decode graphs; same sums as dispatch)."""
        weights, ids = route(self.gate.logits(x), self.gate.e_score_correction_bias, self.top_k,
                             self.renormalize, self.scaling)
        h = self.routed_expert_down_proj(x)
        y = self._routed_dense(h, weights, ids) if static else self._routed_dispatch(h, weights, ids)
        if self.reduce_routed is not None:
            y = self.reduce_routed(y)
        y = y.to(x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    def _local_experts(self) -> range:
        lo, hi = self.expert_range if self.expert_range is not None else (0, len(self.experts))
        return range(lo, hi)

    def _expert(self, e: int, he: torch.Tensor) -> torch.Tensor:
        expert = self.experts[e]
        return expert.w2(situ(expert.w1(he), expert.w3(he), self.beta, self.linear_beta))

    def _routed_dispatch(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert on its tokens only (the chosen set is read on the host)."""
        y = torch.zeros(h.shape, dtype=upcast(h).dtype, device=h.device)
        local = self._local_experts()
        for e in torch.unique(ids).tolist():
            if e not in local:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            out = self._expert(e, h[tok])
            # index_put_ rather than index_add_: the latter costs ~30 ms a call on this CPU build of torch.
            y.index_put_((tok,), upcast(out) * weights[tok, slot, None], accumulate=True)
        return y

    def _routed_dense(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighted by a dense [T, E] routing matrix (zero where not chosen)."""
        dense = torch.zeros(h.shape[0], len(self.experts), dtype=weights.dtype, device=h.device)
        dense.scatter_(1, ids, weights)
        y = torch.zeros(h.shape, dtype=upcast(h).dtype, device=h.device)
        for e in self._local_experts():
            w = dense[:, e, None]
            # where, not a product: an unchosen expert's output never reaches the sum, whatever its value
            y = y + torch.where(w != 0, upcast(self._expert(e, h)) * w, 0.0)
        return y
