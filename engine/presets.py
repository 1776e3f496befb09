"""Generated-checkpoint presets: `tiny` (tests) and `small` (benchmarks).

Both keep every Kimi-K3 layer type (KDA + dense SiTU MLP, KDA + latent MoE, gated MLA + MoE, MLA last,
several AttnRes blocks, shared experts, biased sigmoid router) and the real config keys, so the same
loader and model code run on them and on a real checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.model_config import ModelConfig
from shared.prompt.special_tokens import NUM_SPECIAL_TOKENS, special_id

# BPE ranks of the tokenizer the generated checkpoints ship (shared/prompt/data).
GENERATED_BPE_RANKS = 1024
GENERATED_VOCAB = GENERATED_BPE_RANKS + NUM_SPECIAL_TOKENS


def _top_level(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    n = GENERATED_BPE_RANKS
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": special_id("[BOS]", n),
        "eos_token_id": special_id("<|end_of_msg|>", n),
        "pad_token_id": special_id("[PAD]", n),
        "media_placeholder_token_id": special_id("<|media_pad|>", n),
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


def tiny_config() -> dict[str, Any]:
    """docs/model.md, Presets: vocabulary grown to hold the generated tokenizer, plus a small vision tower."""
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": GENERATED_VOCAB, "hidden_size": 64, "num_hidden_layers": 6,
        "rms_norm_eps": 1e-5, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": 128, "attn_res_block_size": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6],
            "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    vision = {
        "patch_size": 14, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
        "vt_hidden_size": 32, "vt_intermediate_size": 64, "qkv_hidden_size": 32,
        "merge_kernel_size": [2, 2], "text_hidden_size": 64,
        "init_pos_emb_height": 16, "init_pos_emb_width": 16, "max_image_pixels": 224 * 224,
    }
    return _top_level(text, vision)


def small_config() -> dict[str, Any]:
    """A few hundred MB in bf16: big enough that matmuls, not Python, dominate a step."""
    kda = [i for i in range(1, 13) if i % 4 != 0]
    text = {
        **tiny_config()["text_config"],
        "hidden_size": 1024, "num_hidden_layers": 12, "intermediate_size": 2816,
        "attn_res_block_size": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": 384, "kv_lora_rank": 256,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "linear_attn_config": {
            "kda_layers": kda, "full_attn_layers": [4, 8, 12],
            "num_heads": 8, "head_dim": 64, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
        "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 2,
        "moe_intermediate_size": 384, "routed_expert_hidden_size": 512,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 65536, "torch_dtype": "bfloat16",
    }
    vision = {
        "patch_size": 14, "vt_num_hidden_layers": 4, "vt_num_attention_heads": 4,
        "vt_hidden_size": 256, "vt_intermediate_size": 1024, "qkv_hidden_size": 256,
        "merge_kernel_size": [2, 2], "text_hidden_size": 1024,
        "init_pos_emb_height": 32, "init_pos_emb_width": 32, "max_image_pixels": 448 * 448,
    }
    return _top_level(text, vision)


PRESETS = {"tiny": tiny_config, "small": small_config}


# Trained checkpoints shipped as package data (`kimi-pd checkpoint create --preset NAME` copies them).
SHIPPED_DIR = Path(__file__).parent / "presets_data"
SHIPPED_PRESETS = ("tiny-chat",)


def shipped_checkpoint(name: str) -> Path:
    """Directory of a shipped trained checkpoint (FileNotFoundError if the install lacks it)."""
    if name not in SHIPPED_PRESETS:
        raise ValueError(f"unknown shipped checkpoint {name!r}; choose one of {list(SHIPPED_PRESETS)}")
    path = SHIPPED_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the {name} checkpoint is not installed at {path} (package data missing)")
    return path


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name]())


def tiny_chat_config(num_ranks: int, hidden_size: int = 128, num_layers: int = 4,
                     kda_layers: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """The trained `tiny-chat` model: every K3 mixer, sized to train in 20 CPU minutes.

    KDA on layer 1 (position-aware: its short conv and decay give the NoPE attention above it the
    token order), gated NoPE MLA on the rest (copying and lookup; a KDA layer costs ~2x an MLA layer
    in training on CPU); a dense SiTU MLP on layer 0 and latent MoE (8 experts, top-2, one shared)
    after; AttnRes blocks of 2 layers. `num_ranks` is the size of the checkpoint's own tokenizer
    (engine/training/corpus.py), whose special tokens sit above it.
    """
    d = hidden_size
    mla = [i for i in range(1, num_layers + 1) if i not in kda_layers]
    text = {
        **tiny_config()["text_config"],
        "vocab_size": num_ranks + NUM_SPECIAL_TOKENS, "hidden_size": d, "num_hidden_layers": num_layers,
        "intermediate_size": 2 * d, "attn_res_block_size": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": d // 2, "kv_lora_rank": d // 4,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "v_head_dim": 32,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, num_layers + 1) if i not in mla], "full_attn_layers": mla,
            "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": d, "routed_expert_hidden_size": d // 2,
        "routed_scaling_factor": 1.0, "max_position_embeddings": 4096, "torch_dtype": "float32",
    }
    vision = {**tiny_config()["vision_config"], "text_hidden_size": d}
    top = _top_level(text, vision)
    for key, name in (("bos_token_id", "[BOS]"), ("eos_token_id", "<|end_of_msg|>"), ("pad_token_id", "[PAD]"),
                      ("media_placeholder_token_id", "<|media_pad|>")):
        top[key] = special_id(name, num_ranks)
    return top
