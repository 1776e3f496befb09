"""The Kimi-K3 model: decoder layers, text model, LM head and the multimodal wrapper.

Module paths equal the real checkpoint's tensor names (`language_model.model.layers.{l}.self_attn.*`,
`...block_sparse_moe.*`, `vision_tower.*`, `mm_projector.*`), so a real checkpoint's state dict loads
onto this code. Layer wiring (docs/model.md, Layer wiring):

    prefix_sum = h_in
    x = attn_res(prefix_sum, blocks) if blocks else h_in
    if l % B == 0: blocks.append(prefix_sum); prefix_sum = None        # close a block
    prefix_sum = mixer(input_layernorm(x)) (+ prefix_sum)
    x = attn_res(prefix_sum, blocks)
    return prefix_sum + ffn(post_attention_layernorm(x))
"""
from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.model.attnres import AttnResWeights, attn_res, attn_res_norm, site_query
from engine.model.forward_batch import ForwardBatch
from engine.model.gemm import Linear
from engine.model.kda import KDAOptions, KimiDeltaAttention
from engine.model.layers import NormWeight, RMSNorm, SiTUMLP
from engine.model.mla import GatedMLA, MLAOptions
from engine.model.moe import LatentMoE
from shared.model_config import ModelConfig, TextConfig


@dataclass(frozen=True)
class ModelOptions:
    """Runtime choices that do not change the maths (which equivalent kernel form runs)."""

    kda: KDAOptions = field(default_factory=KDAOptions)
    mla: MLAOptions = field(default_factory=MLAOptions)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, options: ModelOptions) -> None:
        super().__init__()
        self.layer_id, self.eps, self.block_size = layer_id, cfg.rms_norm_eps, cfg.attn_res_block_size
        self.self_attn = (KimiDeltaAttention(cfg, layer_id, options.kda) if cfg.is_kda_layer(layer_id)
                          else GatedMLA(cfg, layer_id, options.mla))
        if cfg.is_moe_layer(layer_id):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = SiTUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation_situ_beta,
                               cfg.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn_site, mlp_site = AttnResWeights(cfg.hidden_size), AttnResWeights(cfg.hidden_size)
        self.self_attention_res_norm, self.self_attention_res_proj = attn_site.norm, attn_site.proj
        self.mlp_res_norm, self.mlp_res_proj = mlp_site.norm, mlp_site.proj

    def ffn(self, x: torch.Tensor, static: bool = False) -> torch.Tensor:
        """static: a capture-safe decode step (the MoE routes without host reads)."""
        return self.block_sparse_moe(x, static) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, h: torch.Tensor, blocks: list[torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """h: the previous layer's output (partial block sum); `blocks` grows in place at block starts."""
        prefix_sum: torch.Tensor | None = h
        x = (self._mix_norm(h, blocks, self.self_attention_res_proj, self.self_attention_res_norm,
                            self.input_layernorm) if blocks else self.input_layernorm(h))
        if self.layer_id % self.block_size == 0:
            blocks.append(h)
            prefix_sum = None
        a = self.self_attn(x, batch)
        prefix_sum = a if prefix_sum is None else prefix_sum + a
        x = self._mix_norm(prefix_sum, blocks, self.mlp_res_proj, self.mlp_res_norm, self.post_attention_layernorm)
        return prefix_sum + self.ffn(x, batch.decode is not None)

    def _mix(self, partial: torch.Tensor, blocks: list[torch.Tensor], proj: nn.Linear,
             norm: NormWeight) -> torch.Tensor:
        return attn_res([*blocks, partial], proj.weight, norm.weight, self.eps, site_query(self, proj, norm))

    def _mix_norm(self, partial: torch.Tensor, blocks: list[torch.Tensor], proj: nn.Linear, norm: NormWeight,
                  then: RMSNorm) -> torch.Tensor:
        """`then(attn_res(blocks + [partial]))`: the mixing and the norm after it (one C call in decode steps)."""
        return attn_res_norm([*blocks, partial], proj.weight, norm.weight, self.eps, site_query(self, proj, norm),
                             then.weight, then.eps)


class KimiK3TextModel(nn.Module):
    def __init__(self, cfg: TextConfig, options: ModelOptions) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, options) for i in range(cfg.num_hidden_layers))
        out_site = AttnResWeights(cfg.hidden_size)
        self.output_attn_res_norm, self.output_attn_res_proj = out_site.norm, out_site.proj
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` as what it holds (an nn.ModuleList is untyped); the same object, no copy."""
        return typing.cast("Sequence[DecoderLayer]", self.layers)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [N] -> final normalised hidden states [N, D]."""
        h = self.embed_tokens(input_ids)
        if batch.mm_embeds is not None and batch.mm_positions is not None and batch.mm_positions.numel():
            h = h.index_copy(0, batch.mm_positions, batch.mm_embeds.to(h.dtype))
        blocks: list[torch.Tensor] = []
        capture = set(batch.capture_layers)
        by_layer: dict[int, torch.Tensor] = {}
        for layer in self.decoder_layers:
            h = layer(h, blocks, batch)
            if layer.layer_id in capture:
                by_layer[layer.layer_id] = h          # the AttnRes block's partial sum after this layer
        batch.captured = [by_layer[i] for i in batch.capture_layers]
        h = attn_res([*blocks, h], self.output_attn_res_proj.weight, self.output_attn_res_norm.weight,
                     self.cfg.rms_norm_eps, site_query(self, self.output_attn_res_proj, self.output_attn_res_norm))
        return self.norm(h)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: TextConfig, options: ModelOptions) -> None:
        super().__init__()
        self.model = KimiK3TextModel(cfg, options)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(input_ids, batch)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()


class KimiK3ForConditionalGeneration(nn.Module):
    """Vision tower + projector + text model. Image features replace `<|media_pad|>` embeddings."""

    def __init__(self, config: ModelConfig, options: ModelOptions | None = None, with_rot_proj: bool = False) -> None:
        """with_rot_proj: the projector carries a QuaRot `rot_proj` (ModelSlim checkpoints may ship one)."""
        super().__init__()
        self.config = config
        self.options = options or ModelOptions()
        if config.vision_config is not None:
            from engine.model.vision import MMProjector, MoonViT
            self.vision_tower = MoonViT(config.vision_config)
            self.mm_projector = MMProjector(config.vision_config, with_rot_proj=with_rot_proj)
        self.language_model = KimiLinearForCausalLM(config.text_config, self.options)

    @property
    def has_vision(self) -> bool:
        return hasattr(self, "vision_tower")

    def encode_images(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Preprocessed images [3, H, W] -> per image `[num_tokens, hidden]` in the model dtype."""
        if not self.has_vision:
            raise ValueError("this checkpoint has no vision tower (no vision_config)")
        from engine.model.vision import encode_images
        return encode_images(self.vision_tower, self.mm_projector, pixel_values)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, batch)

    def fuse_linears(self) -> None:
        """Run the linears that read one input as one GEMM each (engine/model/fused.py): after loading
        and any sharding, before serving. The checkpoint's parameters stay, as views of the fused weights."""
        for layer in self.language_model.model.decoder_layers:
            layer.self_attn.fuse_linears()
            (layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp).fuse_linears()

    def unfuse_linears(self) -> None:
        """One GEMM per linear again (baselines and equivalence tests; the parameters stay views)."""
        from engine.model.fused import unfuse_linears
        for module in self.language_model.modules():
            unfuse_linears(module)

    def freeze_decode_weights(self) -> None:
        """Precompute what the mixers derive from their weights, for capture-safe decode steps
        (`ForwardBatch.decode`): a captured graph reads these fixed tensors instead."""
        for module in self.language_model.modules():
            freeze = getattr(module, "freeze_decode_weights", None)
            if freeze is not None:
                freeze()
