"""`kimi-pd checkpoint quantize`: a bf16/fp32 checkpoint -> a ModelSlim W4A8 checkpoint, shard by shard.

Quantization is per tensor (engine/model/quant_description.py: experts W4A8_DYNAMIC, attention and
dense/shared MLP linears W8A8_DYNAMIC, the rest FLOAT), so each input shard becomes one output shard of
the same name and peak memory is one shard. Tokenizer and generation files are copied unchanged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from tqdm import tqdm

from engine.checkpoint.layout import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, QUANT_DESCRIPTION_FILE
from engine.checkpoint.loader import CheckpointError, _weight_map
from engine.model.quant import describe, quantize_state_dict
from shared.model_config import ModelConfig

QUANTIZATION_CONFIG = {"quant_method": "ascend", "format": "modelslim-w4a8-dynamic"}
_COPIED = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json",
           GENERATION_CONFIG_FILE)


def quantize_checkpoint(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    src, dst = Path(src), Path(dst)
    if (src / QUANT_DESCRIPTION_FILE).exists():
        raise CheckpointError(f"{src}: already quantized ({QUANT_DESCRIPTION_FILE} present)")
    config = ModelConfig.from_file(src / CONFIG_FILE)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: not empty; refusing to overwrite")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, types, total = {}, {}, 0
    for shard in tqdm(sorted(set(_weight_map(src).values())), desc="quantizing shards", disable=not progress):
        tensors, description = quantize_state_dict(load_file(str(src / shard)))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / shard), metadata={"format": "pt"})
        types.update(description.tensor_types)
        weight_map.update({name: shard for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / QUANT_DESCRIPTION_FILE).write_text(json.dumps(describe(types).to_dict(), indent=2, sort_keys=True))
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (dst / CONFIG_FILE).write_text(json.dumps({**config.to_dict(), "quantization_config": QUANTIZATION_CONFIG},
                                              indent=2))
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if (src / "tiktoken.model").is_file():
        from shared.prompt.hf_files import save_tokenizer
        from shared.prompt.tokenizer import KimiTokenizer
        save_tokenizer(KimiTokenizer.from_dir(src), dst)      # also gives an older source's copy tokenizer.json
    return dst
