"""The K3 DSpark draft (docs/dspark.md 3.3): a dense MLA stack with RoPE, fed by the target's features.

Context tokens never run through the draft layers: their features become, per draft layer, an MLA
cache row `[kv_a_layernorm(c) | RoPE(k_pe, pos)]` (`context_kv`). A draft step runs only the query
block `[anchor, MASK x (N-1)]` through the layers; each query attends to its request's context rows
plus the whole block (non-causal inside the block). Tensor names equal the checkpoint's
(`context_proj`, `layers.{j}.self_attn.*`, `layers.{j}.mlp.*`, `final_norm`, `markov_head.*`,
`confidence_head.proj`); the embedding and LM head are the target's, passed in, never stored.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.gemm import Linear
from engine.model.layers import RMSNorm, SiTUMLP, upcast
from engine.spec_decode.config import AnyDraftConfig, DraftConfig, GQADraftConfig


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim/2] in fp32 for the default (unscaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved, `is_neox_style=False`) rotation of pairs (x0,x1),(x2,x3)... x: [T, ..., dim]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = upcast(x)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (`is_neox_style=True`, Qwen3's) rotation of the halves (x[:d/2], x[d/2:]). x: [T, ..., dim]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = upcast(x)
    first, second = xf.chunk(2, dim=-1)
    return torch.cat([first * c - second * s, second * c + first * s], dim=-1).to(x.dtype)


class SiLUMLP(nn.Module):
    """KimiMLP with `hidden_act=silu`: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftMLA(nn.Module):
    """MLA with q-LoRA and RoPE on the shared key slice; no NoPE, no output gate, no qk-norm."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.nope = nh, cfg.qk_nope_head_dim
        self.rope, self.v_dim = cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora, self.theta = cfg.kv_lora_rank, cfg.rope_theta
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(nh * self.v_dim, d, bias=False)

    def head_split(self) -> list[tuple[str, int, int]]:
        """(linear, rows per head, heads) of the per-head projections a tensor-parallel rank slices."""
        return [("q_b_proj", self.nope + self.rope, self.num_heads), ("kv_b_proj", self.nope + self.v_dim,
                                                                        self.num_heads)]

    def shard_heads(self, local_heads: int, rank: int) -> None:
        self.num_heads = local_heads

    def cache_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """What the draft cache stores for inputs x at positions (cos/sin): [T, kv_lora + rope]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), apply_rope(k_pe, cos, sin)], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                contexts: list[torch.Tensor], block: int) -> torch.Tensor:
        """x: [R*block, D] query blocks of R requests; contexts[r]: [ctx_r, kv_lora+rope] cache rows."""
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(-1, nh, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        own = self.cache_rows(x, cos, sin)
        w_kvb = upcast(self.kv_b_proj.weight).view(nh, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w_kvb[:, : self.nope], w_kvb[:, self.nope:]
        outs = []
        for r, ctx in enumerate(contexts):
            rows = slice(r * block, (r + 1) * block)
            kv = upcast(torch.cat([ctx.to(own.dtype), own[rows]]))                       # [ctx+block, .]
            c, k_pe = kv.split([self.kv_lora, self.rope], dim=-1)
            ql = upcast(q_nope[rows]).transpose(0, 1) @ w_uk                            # [H, block, kv_lora]
            scores = (ql @ c.t() + upcast(q_pe[rows]).transpose(0, 1) @ k_pe.t()) * self.scale
            out = (torch.softmax(scores, dim=-1) @ c) @ w_uv.transpose(1, 2)             # [H, block, v]
            outs.append(out.transpose(0, 1))
        o = torch.cat(outs).to(x.dtype).reshape(x.shape[0], nh * self.v_dim)
        return self.o_proj(o)


class DraftGQA(nn.Module):
    """Qwen3 attention (RadixArk's GQA draft): q/k/v projections, per-head RMSNorm of q and k, NeoX RoPE
    on the whole head. The cache row of a token is its K (normed, rotated) and V of every KV head."""

    def __init__(self, cfg: GQADraftConfig) -> None:
        super().__init__()
        d, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.v_dim = nh, nkv, hd, hd
        self.group, self.head_offset, self.theta, self.scale = nh // nkv, 0, cfg.rope_theta, hd ** -0.5
        self.q_proj = Linear(d, nh * hd, bias=False)
        self.k_proj = Linear(d, nkv * hd, bias=False)
        self.v_proj = Linear(d, nkv * hd, bias=False)
        self.o_proj = Linear(nh * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def head_split(self) -> list[tuple[str, int, int]]:
        """Query heads split over tensor-parallel ranks; K/V stay whole (the cache rows are replicated)."""
        return [("q_proj", self.head_dim, self.num_heads)]

    def shard_heads(self, local_heads: int, rank: int) -> None:
        self.num_heads, self.head_offset = local_heads, rank * local_heads

    def cache_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k = apply_rope_neox(self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        return torch.cat([k.flatten(1), self.v_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                contexts: list[torch.Tensor], block: int) -> torch.Tensor:
        """x: [R*block, D] query blocks of R requests; contexts[r]: [ctx_r, 2*kv_heads*head_dim] cache rows."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = apply_rope_neox(self.q_norm(self.q_proj(x).view(-1, nh, hd)), cos, sin)
        own = self.cache_rows(x, cos, sin)
        kv_of = (self.head_offset + torch.arange(nh, device=x.device)) // self.group     # each query head's KV
        outs = []
        for r, ctx in enumerate(contexts):
            rows = slice(r * block, (r + 1) * block)
            k, v = upcast(torch.cat([ctx.to(own.dtype), own[rows]])).split(nkv * hd, dim=-1)
            k, v = k.view(-1, nkv, hd)[:, kv_of].transpose(0, 1), v.view(-1, nkv, hd)[:, kv_of].transpose(0, 1)
            scores = upcast(q[rows]).transpose(0, 1) @ k.transpose(1, 2) * self.scale    # [H, block, S]
            outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))            # [block, H, hd]
        return self.o_proj(torch.cat(outs).to(x.dtype).reshape(x.shape[0], nh * hd))


class DraftLayer(nn.Module):
    def __init__(self, cfg: AnyDraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: DraftMLA | DraftGQA = (DraftGQA(cfg) if isinstance(cfg, GQADraftConfig) else DraftMLA(cfg))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SiLUMLP(cfg.hidden_size, cfg.intermediate_size)
                    if isinstance(cfg, GQADraftConfig) or cfg.hidden_act == "silu" else
                    SiTUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation_situ_beta,
                            cfg.activation_situ_linear_beta))


class MarkovHead(nn.Module):
    """Low-rank transition bias: `markov_w1[prev]` (r-dim) projected by `markov_w2` to a vocab bias."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = Linear(input_dim, 1, bias=True)


class DSparkDraftModel(nn.Module):
    """The MLA `k3_dspark` draft; `GQADraftModel` below is the Qwen3 one. Both expose the same four
    operations (`context_kv`, `block_hidden`, `markov_bias`, `confidence`) the proposer runs."""

    cfg: AnyDraftConfig

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.context_proj = Linear(cfg.target_hidden_size * cfg.num_target_layers, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._add_heads(cfg)

    def _add_heads(self, cfg: AnyDraftConfig) -> None:
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov
                                                                     else 0))

    @property
    def _layers(self) -> list[DraftLayer]:
        return cast("list[DraftLayer]", self.layers)      # an nn.ModuleList of them

    @property
    def rope_dim(self) -> int:
        return cast("DraftConfig", self.cfg).qk_rope_head_dim

    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, target_hidden*L] -> the draft's context states [T, D]."""
        return self.context_norm(self.context_proj(features.to(self.context_proj.weight.dtype)))

    def output_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_norm(h)

    # ---- context ---------------------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features [T, target_hidden*L] at `positions` -> cache rows [layers, T, cache_dim]."""
        context = self.context_states(features)
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.cfg.rope_theta)
        return torch.stack([layer.self_attn.cache_rows(context, cos, sin) for layer in self._layers])

    # ---- query block -----------------------------------------------------------------------
    def block_hidden(self, embeds: torch.Tensor, positions: torch.Tensor,
                     contexts: list[list[torch.Tensor]], block: int) -> torch.Tensor:
        """Query blocks [R*block, D] at `positions` -> final-normed hidden [R*block, D].

        contexts[j][r]: request r's context cache rows for draft layer j.
        """
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.cfg.rope_theta)
        h, residual = embeds, None
        for j, layer in enumerate(self._layers):
            residual = h if residual is None else h + residual
            x = layer.input_layernorm(residual)
            a = layer.self_attn(x, cos, sin, contexts[j], block)
            residual = a + residual
            h = layer.mlp(layer.post_attention_layernorm(residual))
        assert residual is not None                    # a draft has at least one layer
        return self.output_norm(h + residual)

    def markov_bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev token ids [R] -> (embedding e [R, r], bias [R, V] = logit_scale * w2 e)."""
        e = self.markov_head.markov_w1(prev)
        return e, self.markov_head.markov_w2(e).float() * self.cfg.logit_scale

    def confidence(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor | None:
        if not hasattr(self, "confidence_head"):
            return None
        x = torch.cat([hidden, markov_embed], dim=-1) if self.cfg.confidence_head_with_markov else hidden
        proj = self.confidence_head.proj                # at least fp32 (an fp64 engine keeps fp64)
        dtype = torch.promote_types(proj.weight.dtype, torch.float32)
        bias = None if proj.bias is None else proj.bias.to(dtype)
        return torch.sigmoid(F.linear(x.to(dtype), proj.weight.to(dtype), bias).float()).squeeze(-1)


class GQADraftModel(DSparkDraftModel):
    """The Qwen3 (GQA) DSpark draft; module names are its checkpoint's: `fc`, `hidden_norm`, `layers.{j}.
    self_attn.{q,k,v,o}_proj|q_norm|k_norm`, `layers.{j}.mlp.*`, `norm`, `markov_head.*`, `confidence_head.proj`."""

    def __init__(self, cfg: GQADraftConfig) -> None:
        nn.Module.__init__(self)            # not DSparkDraftModel's: its own module names, the same operations
        self.cfg = cfg
        self.fc = Linear(cfg.target_hidden_size * cfg.num_target_layers, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._add_heads(cfg)

    @property
    def rope_dim(self) -> int:
        return cast("GQADraftConfig", self.cfg).head_dim

    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def output_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


def draft_model_for(cfg: AnyDraftConfig) -> DSparkDraftModel:
    """The draft model of either attention, uninitialised."""
    return GQADraftModel(cfg) if isinstance(cfg, GQADraftConfig) else DSparkDraftModel(cfg)
