"""File names and small JSON files of the Hugging Face checkpoint layout (docs/design.md, Checkpoints)."""
from __future__ import annotations

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
QUANT_DESCRIPTION_FILE = "quant_model_description.json"

# Parameters the real checkpoint keeps in fp32 whatever the model dtype (docs/model.md, Shared building blocks).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "weight_scale", "weight_offset", "scale_bias")
ROT_PROJ_TENSOR = "mm_projector.rot_proj.weight"


def shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)
