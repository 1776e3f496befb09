"""A padded-batch forward `[B, T] -> logits [B, T, V]` over the serving model's own modules, for training.

The serving forward (`KimiK3ForConditionalGeneration.forward`) runs a flattened batch whose mixers
loop over sequences and write a paged cache; autograd through that is correct but spends most of a
training step in Python. This forward computes the same maths with the batch as a tensor dimension:
KDA's chunked form with the batch folded into the head dimension (heads are independent) and its
intra-chunk decays factorised into matmuls (`kda_dense.py`), the short conv as one grouped `conv1d`,
MLA's materialised causal attention as `[B, H, T, T]`. Norms, AttnRes, SiTU and the latent MoE are the
modules' own token-wise code. It uses the very same parameters, so a model trained here is the model
served; `tests/engine/test_training.py` checks the logits equal the serving forward's (and the engine's
paged greedy decode) on real prompts.

Sequences are right-padded; everything is causal, so a token never sees the padding after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attnres import attn_res
from engine.model.kda import KimiDeltaAttention
from engine.model.kda_ops import kda_gate
from engine.model.kimi_k3 import DecoderLayer, KimiK3ForConditionalGeneration
from engine.model.layers import l2norm, rms_norm, upcast
from engine.model.mla import GatedMLA
from engine.training.kda_dense import kda_chunked_dense


def dense_logits(model: KimiK3ForConditionalGeneration, input_ids: torch.Tensor, kda_chunk_size: int = 16,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids [B, T] -> logits [B, T, V] (fp32), or [P, V] at the `positions` of a bool mask [B, T].

    Training takes the loss on the answer tokens only, so the head (norm, lm_head) runs on those.
    """
    lm = model.language_model
    text = lm.model
    b, t = input_ids.shape
    h = text.embed_tokens(input_ids).reshape(b * t, -1)
    blocks: list[torch.Tensor] = []
    for layer in text.decoder_layers:
        h = _layer(layer, h, blocks, b, t, kda_chunk_size)
    sources = [*blocks, h]
    if positions is not None:                           # the output AttnRes and the head are token-wise
        sources = [x[positions.reshape(-1)] for x in sources]
    h = attn_res(sources, text.output_attn_res_proj.weight, text.output_attn_res_norm.weight, text.cfg.rms_norm_eps)
    logits = lm.lm_head(text.norm(h)).float()
    return logits if positions is not None else logits.view(b, t, -1)


def _layer(layer: DecoderLayer, h: torch.Tensor, blocks: list[torch.Tensor], b: int, t: int,
           chunk: int) -> torch.Tensor:
    """`DecoderLayer.forward` with the dense mixers (same block wiring, docs/model.md, Layer wiring)."""
    prefix_sum: torch.Tensor | None = h
    x = layer._mix(h, blocks, layer.self_attention_res_proj, layer.self_attention_res_norm) if blocks else h
    if layer.layer_id % layer.block_size == 0:
        blocks.append(h)
        prefix_sum = None
    normed = layer.input_layernorm(x)
    mixer = layer.self_attn
    a = _kda(mixer, normed, b, t, chunk) if isinstance(mixer, KimiDeltaAttention) else _mla(mixer, normed, b, t)
    prefix_sum = a if prefix_sum is None else prefix_sum + a
    x = layer._mix(prefix_sum, blocks, layer.mlp_res_proj, layer.mlp_res_norm)
    return prefix_sum + layer.ffn(layer.post_attention_layernorm(x))


def _kda(m: KimiDeltaAttention, x: torch.Tensor, b: int, t: int, chunk: int) -> torch.Tensor:
    nh, k = m.num_heads, m.head_dim
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)                 # [BT, 3HK]
    g = kda_gate(m.f_b_proj(m.f_a_proj(x)).view(-1, nh, k), m.head_a_log(), m.dt_bias, m.lower_bound)
    beta = torch.sigmoid(upcast(m.b_proj(x)))                                          # [BT, H]
    conv_w = upcast(m.conv_weight())                                                   # [C, W]
    w = conv_w.shape[-1]
    seq = upcast(qkv).view(b, t, -1).transpose(1, 2)                                   # [B, C, T]
    mixed = F.silu(F.conv1d(F.pad(seq, (w - 1, 0)), conv_w[:, None, :], groups=conv_w.shape[0]))
    mixed = mixed.to(x.dtype).transpose(1, 2)                                          # [B, T, C]
    q, kk, v = upcast(mixed).reshape(b, t, 3, nh, k).unbind(2)
    q, kk = l2norm(q), l2norm(kk)

    def fold(z: torch.Tensor) -> torch.Tensor:                                         # [B, T, H, .] -> [B*H, T, .]
        return z.transpose(1, 2).reshape(b * nh, t, *z.shape[3:])

    o = kda_chunked_dense(fold(q), fold(kk), fold(v), fold(g.view(b, t, nh, k)), fold(beta.view(b, t, nh)),
                          k ** -0.5, chunk)
    out = o.view(b, nh, t, k).transpose(1, 2).reshape(b * t, nh, k)
    gate = m.g_proj(x).view(-1, nh, k)
    y = upcast(rms_norm(out, m.o_norm.weight, m.eps)) * torch.sigmoid(upcast(gate))
    return m.o_proj(y.to(x.dtype).reshape(b * t, nh * k))


def _mla(m: GatedMLA, x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    nh = m.num_heads
    q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x))).view(b, t, nh, m.nope + m.rope)
    q_nope, q_pe = upcast(q).split([m.nope, m.rope], dim=-1)
    c, k_pe = upcast(m.latent(x)).view(b, t, -1).split([m.kv_lora, m.rope], dim=-1)
    w_kvb = upcast(m.kv_b_proj.weight).view(nh, m.nope + m.v_dim, m.kv_lora)
    w_uk, w_uv = w_kvb[:, : m.nope], w_kvb[:, m.nope:]
    k_nope = torch.einsum("btc,hnc->bhtn", c, w_uk)
    v = torch.einsum("btc,hvc->bhtv", c, w_uv)
    q_nope, q_pe = q_nope.transpose(1, 2), q_pe.transpose(1, 2)                        # [B, H, T, .]
    scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)
    mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
    probs = torch.softmax((scores * m.scale).masked_fill(mask, float("-inf")), dim=-1)
    out = (probs @ v).transpose(1, 2).to(x.dtype).reshape(b * t, -1)                   # [BT, H*v]
    gate = torch.sigmoid(upcast(m.g_proj(x))).to(x.dtype)
    return m.o_proj(out * gate)
