"""Kimi-K3 configuration (torch-free: the router reads it too): the real `config.json` keys as frozen
dataclasses, parsed once.

`ModelConfig.from_dict` validates required keys, types and cross-field consistency and raises
`ConfigError` naming the offending key. Keys we do not model (HF bookkeeping such as `auto_map`,
`transformers_version`) are kept verbatim in `extra` so a real checkpoint's config loads and
re-serialises unchanged.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi-K3 model."""


def _take(d: dict[str, Any], cls: type, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `d` into the dataclass fields of `cls` (type-checked) and the rest."""
    known: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key, value in d.items():
        (known if key in fields else extra)[key] = value
    for name, f in fields.items():
        if name not in known and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key '{name}'")
    return known, extra


def _check_type(where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ConfigError(f"{where}.{key}: expected {kind}, got bool")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                          f"got {type(value).__name__} ({value!r})")


@dataclass(frozen=True)
class LinearAttnConfig:
    kda_layers: tuple[int, ...]          # 1-based
    full_attn_layers: tuple[int, ...]    # 1-based
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "text_config.linear_attn_config") -> LinearAttnConfig:
        known, extra = _take(d, cls, where)
        for key in ("kda_layers", "full_attn_layers"):
            _check_type(where, key, known[key], (list, tuple))
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in known[key]):
                raise ConfigError(f"{where}.{key}: expected a list of ints")
            known[key] = tuple(known[key])
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            if key in known:
                _check_type(where, key, known[key], int)
        return cls(**known)


@dataclass(frozen=True)
class TextConfig:
    """`text_config` of a Kimi-K3 checkpoint (model_type `kimi_linear`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_attn_config: LinearAttnConfig
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    num_key_value_heads: int | None = None
    model_type: str = "kimi_linear"
    architectures: tuple[str, ...] = ("KimiLinearForCausalLM",)
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    attn_res_block_size: int = 12
    mla_use_nope: bool = True
    mla_use_rope: bool = False
    mla_use_output_gate: bool = True
    num_shared_experts: int = 2
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ---- derived -------------------------------------------------------------------------
    def is_kda_layer(self, layer: int) -> bool:
        """0-based layer index -> True when its mixer is KDA."""
        return (layer + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: normalized latent + un-rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_projection_size(self) -> int:
        return self.linear_attn_config.num_heads * self.linear_attn_config.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "text_config") -> TextConfig:
        known, extra = _take(d, cls, where)
        known.pop("extra", None)
        known["linear_attn_config"] = LinearAttnConfig.from_dict(known["linear_attn_config"])
        ints = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "num_experts", "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                "attn_res_block_size", "num_shared_experts", "first_k_dense_replace", "moe_layer_freq")
        for key in ints:
            if key in known:
                _check_type(where, key, known[key], int)
                if known[key] < 0:
                    raise ConfigError(f"{where}.{key}: must be >= 0, got {known[key]}")
        for key in ("rms_norm_eps", "activation_situ_beta", "routed_scaling_factor"):
            if key in known:
                _check_type(where, key, known[key], (int, float))
        if "architectures" in known:
            known["architectures"] = tuple(known["architectures"])
        cfg = cls(**known, extra=extra)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "text_config") -> None:
        lac = self.linear_attn_config
        n = self.num_hidden_layers
        kda, full = set(lac.kda_layers), set(lac.full_attn_layers)
        if kda & full:
            raise ConfigError(f"{where}.linear_attn_config: layers {sorted(kda & full)} are both KDA "
                              "and full attention")
        if kda | full != set(range(1, n + 1)):
            missing = sorted(set(range(1, n + 1)) - (kda | full))
            raise ConfigError(f"{where}.linear_attn_config: kda_layers + full_attn_layers must cover 1..{n}; "
                              f"missing {missing}")
        if lac.head_dim < lac.num_heads:
            raise ConfigError(f"{where}.linear_attn_config: head_dim {lac.head_dim} < num_heads {lac.num_heads}; "
                              "A_log is stored padded to head_dim")
        if self.hidden_act != "situ":
            raise ConfigError(f"{where}.hidden_act: only 'situ' is implemented, got {self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            raise ConfigError(f"{where}.moe_router_activation_func: only 'sigmoid' is implemented")
        if not self.mla_use_nope or self.mla_use_rope:
            raise ConfigError(f"{where}: Kimi-K3 MLA is NoPE (mla_use_nope=true, mla_use_rope=false)")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"{where}.num_experts_per_token: must be in 1..num_experts")
        if self.activation_situ_beta <= 0:
            raise ConfigError(f"{where}.activation_situ_beta: must be > 0")
        if self.attn_res_block_size < 1:
            raise ConfigError(f"{where}.attn_res_block_size: must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d["linear_attn_config"] = {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in d["linear_attn_config"].items()}
        d["architectures"] = list(d["architectures"])
        if d["quantization_config"] is None:
            d.pop("quantization_config")
        if d["num_key_value_heads"] is None:
            d["num_key_value_heads"] = d["num_attention_heads"]
        return {**d, **extra}


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config`: a MoonViT-style patch encoder plus the patch-merger projector."""

    patch_size: int = 14
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    text_hidden_size: int = 7168
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    max_image_pixels: int = 1024 * 1024
    rms_norm_eps: float = 1e-5
    model_type: str = "kimi_k3_vision"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "vision_config") -> VisionConfig:
        known, extra = _take(d, cls, where)
        known.pop("extra", None)
        if "merge_kernel_size" in known:
            known["merge_kernel_size"] = tuple(known["merge_kernel_size"])
        for key in ("patch_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_hidden_size",
                    "vt_intermediate_size", "qkv_hidden_size", "text_hidden_size"):
            if key in known:
                _check_type(where, key, known[key], int)
        cfg = cls(**known, extra=extra)
        if cfg.qkv_hidden_size % cfg.vt_num_attention_heads:
            raise ConfigError(f"{where}.qkv_hidden_size must divide by vt_num_attention_heads")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d["merge_kernel_size"] = list(d["merge_kernel_size"])
        return {**d, **extra}


@dataclass(frozen=True)
class ModelConfig:
    """Top-level `config.json` (model_type `kimi_k3`, `KimiK3ForConditionalGeneration`)."""

    text_config: TextConfig
    vision_config: VisionConfig | None = None
    model_type: str = "kimi_k3"
    architectures: tuple[str, ...] = ("KimiK3ForConditionalGeneration",)
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    media_placeholder_token_id: int = 163605
    tie_word_embeddings: bool = False
    quantization_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError("config.json: top level must be an object")
        known, extra = _take(d, cls, "config")
        known.pop("extra", None)
        if known.get("model_type", "kimi_k3") != "kimi_k3":
            raise ConfigError(f"config.model_type: expected 'kimi_k3', got {known['model_type']!r}")
        _check_type("config", "text_config", known["text_config"], dict)
        known["text_config"] = TextConfig.from_dict(known["text_config"])
        if known.get("vision_config") is not None:
            known["vision_config"] = VisionConfig.from_dict(known["vision_config"])
        if "architectures" in known:
            known["architectures"] = tuple(known["architectures"])
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            if key in known:
                _check_type("config", key, known[key], int)
                if not 0 <= known[key] < known["text_config"].vocab_size:
                    raise ConfigError(f"config.{key}: {known[key]} is outside the vocabulary "
                                      f"(vocab_size {known['text_config'].vocab_size})")
        return cls(**known, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: no config.json") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        except TypeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": list(self.architectures),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.text_config.to_dict(),
        }
        if self.vision_config is not None:
            d["vision_config"] = self.vision_config.to_dict()
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config
        return {**d, **self.extra}

    def identity_hash(self) -> str:
        """Stable hash of everything that changes the model's maths (used by handshakes and prefix hashing)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
