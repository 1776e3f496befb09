"""Load a Kimi-K3 checkpoint (generated or real) onto the model, shard by shard, validating as it goes.

Every problem is a `CheckpointError` naming the tensor and the file: a tensor the model needs that no
shard has, one the model does not know, a wrong shape, a wrong dtype kind (float vs int), a missing
shard. The model is built on the meta device and materialised empty, so peak memory is the model plus
one tensor, not the model plus a whole shard copy.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.checkpoint.layout import (
    CONFIG_FILE,
    INDEX_FILE,
    QUANT_DESCRIPTION_FILE,
    ROT_PROJ_TENSOR,
    SINGLE_FILE,
    keeps_fp32,
)
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration, ModelOptions
from shared.model_config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory whose files do not describe the configured model."""


def _weight_map(ckpt: Path) -> dict[str, str]:
    index = ckpt / INDEX_FILE
    if index.exists():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
    if (ckpt / SINGLE_FILE).exists():
        with safe_open(str(ckpt / SINGLE_FILE), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)     # a safe_open handle is not iterable: keys() it is
    raise CheckpointError(f"{ckpt}: neither {INDEX_FILE} nor {SINGLE_FILE}")


def _check_tensor(name: str, fname: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    shape, dtype = tuple(got.shape), got.dtype
    if shape != tuple(expected.shape):
        raise CheckpointError(f"{fname}: tensor '{name}' has shape {list(shape)}, "
                              f"the config needs {list(expected.shape)}")
    if dtype.is_floating_point != expected.dtype.is_floating_point or (
            not dtype.is_floating_point and dtype != expected.dtype):
        raise CheckpointError(f"{fname}: tensor '{name}' has dtype {dtype}, expected "
                              f"{expected.dtype if not expected.dtype.is_floating_point else 'a floating dtype'}")


def build_model(config: ModelConfig, ckpt: Path, dtype: torch.dtype, device: torch.device,
                options: ModelOptions | None, with_rot_proj: bool = False) -> KimiK3ForConditionalGeneration:
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, options, with_rot_proj=with_rot_proj)
    quant_file = ckpt / QUANT_DESCRIPTION_FILE
    if quant_file.exists():
        from engine.model.quant import QuantDescription, apply_quant_description
        try:
            description = QuantDescription.from_dict(json.loads(quant_file.read_text()))
        except (json.JSONDecodeError, ValueError) as exc:
            raise CheckpointError(f"{quant_file}: {exc}") from exc
        apply_quant_description(model, description)
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point:
            p.data = p.data.to(torch.float32 if keeps_fp32(name) and dtype != torch.float64 else dtype)
    return model


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    options: ModelOptions | None = None, progress: bool = False) -> KimiK3ForConditionalGeneration:
    """Validate and load `path` into a new model in `dtype` on `device` (eval mode)."""
    ckpt = Path(path)
    if not (ckpt / CONFIG_FILE).exists():
        raise CheckpointError(f"{ckpt}: no {CONFIG_FILE} (is this a checkpoint directory?)")
    try:
        config = ModelConfig.from_file(ckpt / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    weight_map = _weight_map(ckpt)
    model = build_model(config, ckpt, dtype, torch.device(device), options, ROT_PROJ_TENSOR in weight_map)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise CheckpointError(f"{ckpt}: tensor '{missing[0]}' is missing from every shard"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    for fname in tqdm(sorted(by_file), desc="loading shards", unit="shard", disable=not progress):
        _load_shard(ckpt / fname, by_file[fname], expected)
    log.info("loaded %s (%d tensors, %d shards)", ckpt, len(weight_map), len(by_file))
    return model.eval()


def _load_shard(file: Path, names: list[str], expected: dict[str, torch.Tensor]) -> None:
    if not file.exists():
        raise CheckpointError(f"{file}: shard listed in the index is missing (holds '{names[0]}')")
    with safe_open(str(file), framework="pt") as f:
        present = set(f.keys())
        for name in names:
            if name not in expected:
                raise CheckpointError(f"{file.name}: tensor '{name}' is not part of this model's config")
            if name not in present:
                raise CheckpointError(f"{file.name}: tensor '{name}' is listed in the index but not in the file")
            target = expected[name]
            sl = f.get_slice(name)
            meta = torch.empty(sl.get_shape(), dtype=_st_dtype(sl.get_dtype()), device="meta")
            _check_tensor(name, file.name, meta, target)
            with torch.no_grad():
                target.copy_(f.get_tensor(name).to(target.dtype))


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _st_dtype(name: str) -> torch.dtype:
    return _ST_DTYPES.get(name, torch.uint8)
