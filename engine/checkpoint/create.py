"""`kimi-pd checkpoint create`: write a generated Kimi-K3 checkpoint in the real HF layout."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.checkpoint.init import init_weights
from engine.checkpoint.layout import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    QUANT_DESCRIPTION_FILE,
    keeps_fp32,
    shard_name,
)
from engine.dtypes import torch_dtype
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from engine.presets import PRESETS, SHIPPED_PRESETS, shipped_checkpoint
from shared.model_config import ModelConfig
from shared.prompt.hf_files import save_tokenizer

log = logging.getLogger(__name__)

SHARD_BYTES = {"tiny": 1 << 20, "small": 96 << 20}


def generated_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for `config`, cast to its `torch_dtype` (fp32-only params stay fp32)."""
    model = KimiK3ForConditionalGeneration(config)
    init_weights(model, seed)
    dtype = torch_dtype(config.text_config.torch_dtype)
    return {name: (t if keeps_fp32(name) else t.to(dtype)).contiguous()
            for name, t in model.state_dict().items()}


def split_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in name order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_safetensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, progress: bool = True) -> None:
    shards = split_shards(tensors, max_shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(tqdm(shards, desc="writing shards", unit="shard", disable=not progress), start=1):
        fname = shard_name(i, len(shards))
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def generation_config(config: ModelConfig) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id, "do_sample": False, "temperature": 1.0, "top_p": 1.0}


def create_checkpoint(preset: str, out: str | Path, seed: int = 0, quant: str | None = None,
                      progress: bool = True) -> Path:
    """Write config.json, sharded safetensors + index, tokenizer files, generation_config.json.

    quant="w4a8" writes a ModelSlim W4A8 checkpoint (experts W4A8_DYNAMIC, linears W8A8_DYNAMIC) plus
    quant_model_description.json, transformed from the same float weights.
    """
    from shared.prompt.tokenizer import KimiTokenizer

    if preset in SHIPPED_PRESETS:
        return copy_shipped(preset, out, seed, quant)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted([*PRESETS, *SHIPPED_PRESETS])}")
    if quant not in (None, "w4a8"):
        raise ValueError(f"unknown quantization {quant!r}; supported: w4a8")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(PRESETS[preset]())
    tensors = generated_state_dict(config, seed)
    config_dict = config.to_dict()
    if quant == "w4a8":
        from engine.model.quant import quantize_state_dict
        tensors, description = quantize_state_dict(tensors)
        (out / QUANT_DESCRIPTION_FILE).write_text(json.dumps(description.to_dict(), indent=2, sort_keys=True))
        from engine.checkpoint.quantize import QUANTIZATION_CONFIG
        config_dict["quantization_config"] = QUANTIZATION_CONFIG
    (out / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2))
    write_safetensors(out, tensors, SHARD_BYTES.get(preset, 1 << 30), progress)
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config(config), indent=2))
    save_tokenizer(KimiTokenizer.generated(), out)
    log.info("wrote %s checkpoint (seed %d, quant %s) to %s", preset, seed, quant, out)
    return out


def copy_shipped(preset: str, out: str | Path, seed: int = 0, quant: str | None = None) -> Path:
    """Copy a shipped trained checkpoint; it has fixed weights, so `seed` and `quant` must be defaults."""
    import shutil
    if quant is not None:
        raise ValueError(f"--quant does not apply to the trained {preset} preset "
                         "(quantize a copy with `kimi-pd checkpoint quantize`)")
    if seed != 0:
        raise ValueError(f"--seed does not apply to the trained {preset} preset (its weights are fixed; "
                         "retrain with `kimi-pd checkpoint train --seed N`)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(shipped_checkpoint(preset).iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    if (out / "tiktoken.model").is_file():
        from shared.prompt.tokenizer import KimiTokenizer
        save_tokenizer(KimiTokenizer.from_dir(out), out)   # this writer's tokenizer files (tokenizer.json, template)
    log.info("copied the %s checkpoint to %s", preset, out)
    return out
