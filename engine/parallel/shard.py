"""Shard a loaded Kimi-K3 model in place for one rank (gpt-fast style: load whole, keep a slice).

| part | split | put back together by |
|---|---|---|
| MLA `q_b_proj`, `kv_b_proj`, `g_proj` | heads (output rows) | - (attention is per head) |
| MLA `o_proj`, KDA `o_proj` | heads (input columns) | all-reduce (`RowParallelLinear`) |
| MLA `q_a_proj`, `kv_a_proj_with_mqa`, latent norms | replicated | - (the cached latent is replicated) |
| KDA `q/k/v_proj`, convs, `f_b_proj`, `dt_bias`, `A_log`, `b_proj`, `g_proj` | heads | - (the KDA state is per head) |
| dense MLP and shared experts | `gate/up` by columns, `down` by rows | all-reduce |
| routed experts, TP | `w1/w3` by columns, `w2` by rows | one all-reduce of the routed sum (W4A8: per expert, exact) |
| routed experts, EP | whole experts, E/N per rank | one all-reduce of the routed sum |
| routed experts, DP > 1 | whole (EP) or by intermediate dim, over D x TP ranks | tokens gathered, sums all-reduced |
| router, latent down/up projections, norms, AttnRes | replicated | - |
| `embed_tokens`, `lm_head` | vocabulary rows | all-reduce / all-gather |

The vision tower stays replicated (it runs once per image, before the text model).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.kda import KimiDeltaAttention
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from engine.model.layers import SiTUMLP
from engine.model.mla import GatedMLA
from engine.model.moe import LatentMoE
from engine.parallel.comm import TPGroup
from engine.parallel.config import ParallelConfig
from engine.parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, shard_in, shard_out


def _range(total: int, rank: int, world: int) -> tuple[int, int]:
    step = total // world
    return rank * step, (rank + 1) * step


@torch.no_grad()
def shard_model(model: KimiK3ForConditionalGeneration, parallel: ParallelConfig, group: TPGroup,
                expert_parallel=None) -> None:
    """expert_parallel: the DP x TP exchange (`dp_comm.ExpertParallel`) when data-parallel ranks share the experts."""
    cfg = model.config.text_config
    parallel.check(cfg)
    if expert_parallel is not None:
        for layer in model.language_model.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                _spread_experts(layer.block_sparse_moe, parallel.enable_expert_parallel, expert_parallel)
    if group.world_size > 1:
        _shard_tp(model, parallel, group, expert_parallel is None)


def _spread_experts(moe: LatentMoE, whole: bool, ep) -> None:
    """Routed experts over every DP x TP rank: whole experts (EP) or each by its intermediate dim."""
    moe.expert_parallel = ep
    if whole:
        e0, e1 = _range(len(moe.experts), ep.rank, ep.world_size)
        for e in range(len(moe.experts)):
            if not e0 <= e < e1:
                moe.experts[e] = nn.Module()
        moe.expert_range = (e0, e1)
        return
    if not isinstance(moe.experts[0].w2, nn.Linear):
        raise ValueError("a quantized checkpoint with --data-parallel-size > 1 needs --enable-expert-parallel")
    for expert in moe.experts:                        # float: the partial sums add up in the all-reduce
        lo, hi = _range(expert.w1.out_features, ep.rank, ep.world_size)
        expert.w1, expert.w3 = shard_out(expert.w1, lo, hi), shard_out(expert.w3, lo, hi)
        expert.w2 = shard_in(expert.w2, lo, hi)


def _shard_tp(model: KimiK3ForConditionalGeneration, parallel: ParallelConfig, group: TPGroup,
              routed: bool) -> None:
    rank, world = group.rank, group.world_size
    cfg, lm = model.config.text_config, model.language_model
    lo, hi = _range(cfg.vocab_size, rank, world)
    lm.model.embed_tokens = VocabParallelEmbedding(lm.model.embed_tokens, lo, hi, group)
    lm.lm_head = VocabParallelHead(shard_out(lm.lm_head, lo, hi), group)
    for layer in lm.model.layers:
        attn = layer.self_attn
        if isinstance(attn, GatedMLA):
            _shard_mla(attn, rank, world, group)
        else:
            _shard_kda(attn, rank, world, group)
        if hasattr(layer, "block_sparse_moe"):
            _shard_moe(layer.block_sparse_moe, parallel.enable_expert_parallel, rank, world, group, routed)
        else:
            _shard_mlp(layer.mlp, rank, world, group)


def _shard_mla(attn: GatedMLA, rank: int, world: int, group: TPGroup) -> None:
    h0, h1 = _range(attn.num_heads, rank, world)
    qk, kv, v = attn.nope + attn.rope, attn.nope + attn.v_dim, attn.v_dim
    attn.q_b_proj = shard_out(attn.q_b_proj, h0 * qk, h1 * qk)
    attn.kv_b_proj = shard_out(attn.kv_b_proj, h0 * kv, h1 * kv)
    attn.g_proj = shard_out(attn.g_proj, h0 * v, h1 * v)
    attn.o_proj = RowParallelLinear(shard_in(attn.o_proj, h0 * v, h1 * v), group)
    attn.num_heads = h1 - h0


def _shard_kda(attn: KimiDeltaAttention, rank: int, world: int, group: TPGroup) -> None:
    h0, h1 = _range(attn.num_heads, rank, world)
    k = attn.head_dim
    c0, c1 = h0 * k, h1 * k
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_proj"):
        setattr(attn, name, shard_out(getattr(attn, name), c0, c1))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        full: nn.Conv1d = getattr(attn, name)
        conv = nn.Conv1d(c1 - c0, c1 - c0, full.kernel_size[0], groups=c1 - c0, bias=False, device="meta")
        conv.weight = nn.Parameter(full.weight[c0:c1].clone(), requires_grad=False)
        setattr(attn, name, conv)
    attn.dt_bias = nn.Parameter(attn.dt_bias[c0:c1].clone(), requires_grad=False)
    a_log = torch.zeros_like(attn.A_log)                 # checkpoint layout: per-head values first
    a_log[: h1 - h0] = attn.head_a_log()[h0:h1]
    attn.A_log = nn.Parameter(a_log, requires_grad=False)
    attn.b_proj = shard_out(attn.b_proj, h0, h1)
    attn.o_proj = RowParallelLinear(shard_in(attn.o_proj, c0, c1), group)
    attn.num_heads = h1 - h0


def _shard_mlp(mlp: SiTUMLP, rank: int, world: int, group: TPGroup) -> None:
    lo, hi = _range(mlp.gate_proj.out_features, rank, world)
    mlp.gate_proj, mlp.up_proj = shard_out(mlp.gate_proj, lo, hi), shard_out(mlp.up_proj, lo, hi)
    mlp.down_proj = RowParallelLinear(shard_in(mlp.down_proj, lo, hi), group)


def _shard_moe(moe: LatentMoE, expert_parallel: bool, rank: int, world: int, group: TPGroup, routed: bool) -> None:
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, world, group)
    if not routed:                                    # data parallel: the routed experts are spread already
        return
    if expert_parallel:
        e0, e1 = _range(len(moe.experts), rank, world)
        for e in range(len(moe.experts)):
            if not e0 <= e < e1:
                moe.experts[e] = nn.Module()             # another rank's expert: nothing held here
        moe.expert_range = (e0, e1)
        moe.reduce_routed = group.all_reduce
        return
    quantized = not isinstance(moe.experts[0].w2, nn.Linear)
    for expert in moe.experts:
        lo, hi = _range(expert.w1.out_features, rank, world)
        expert.w1, expert.w3 = shard_out(expert.w1, lo, hi), shard_out(expert.w3, lo, hi)
        down = shard_in(expert.w2, lo, hi)
        # Float: partial expert outputs sum linearly, so one all-reduce of the routed sum serves all
        # experts. Quantized: each expert reduces its own int32 products (bit-exact, see layers.py).
        expert.w2 = RowParallelLinear(down, group) if quantized else down
    if not quantized:
        moe.reduce_routed = group.all_reduce
