"""Draft checkpoints in the `k3_dspark` layout: `config.json` + `model.safetensors` (docs/dspark.md 3.1, 3.3).

`create_draft_checkpoint` sizes a random draft for a given target (tests, and the start point of
`train-draft`); `load_draft` validates names, shapes and the fit to the target, and returns the
model in eval mode. The target's `embed_tokens` / `lm_head` are shared, so a draft file that carries
them has them ignored, as vLLM does.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.init import init_weights
from engine.spec_decode.config import (
    AnyDraftConfig,
    DraftConfig,
    GQADraftConfig,
    SpecConfigError,
    read_draft_config,
    shipped_draft,
)
from engine.spec_decode.draft_model import DSparkDraftModel, draft_model_for
from shared.model_config import ModelConfig, TextConfig

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
SHARED_WITH_TARGET = ("embed_tokens", "lm_head")
# A reserved special-token offset used as the MASK token of generated drafts.
_MASK_SPECIAL_OFFSET = 253


def default_target_layers(num_layers: int) -> list[int]:
    """Early, middle and last target layers (0-based): low/mid/high features, the last closest to the
    next-token distribution the draft must match."""
    return sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1})


def draft_config_for(target: ModelConfig, block: int, num_layers: int = 2, seed: int = 0) -> DraftConfig:
    text: TextConfig = target.text_config
    from shared.prompt.special_tokens import NUM_SPECIAL_TOKENS
    # the special tokens sit above the BPE ranks: a reserved one is the MASK (never in a prompt)
    mask = text.vocab_size - NUM_SPECIAL_TOKENS + _MASK_SPECIAL_OFFSET
    layers = default_target_layers(text.num_hidden_layers)
    return DraftConfig(
        hidden_size=text.hidden_size, num_hidden_layers=num_layers, num_attention_heads=text.num_attention_heads,
        q_lora_rank=text.q_lora_rank, kv_lora_rank=text.kv_lora_rank, qk_nope_head_dim=text.qk_nope_head_dim,
        qk_rope_head_dim=text.qk_rope_head_dim, v_head_dim=text.v_head_dim,
        intermediate_size=2 * text.hidden_size, vocab_size=text.vocab_size, target_layer_ids=tuple(layers),
        num_target_layers=len(layers), target_hidden_size=text.hidden_size, markov_rank=max(8, text.hidden_size // 4),
        mask_token_id=mask, block_size=block, rms_norm_eps=text.rms_norm_eps, enable_confidence_head=True,
        confidence_head_with_markov=True, torch_dtype="float32",
        extra={"kimi_pd_target": target.identity_hash(), "kimi_pd_seed": seed})


def gqa_draft_config_for(target: ModelConfig, block: int, num_layers: int = 2, seed: int = 0) -> GQADraftConfig:
    """The GQA (Qwen3-style) draft for `target`: the MLA draft's taps, MASK and heads, KV heads halved."""
    mla = draft_config_for(target, block, num_layers, seed)
    heads = mla.num_attention_heads
    return GQADraftConfig(
        hidden_size=mla.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=mla.hidden_size // heads,
        intermediate_size=mla.intermediate_size, vocab_size=mla.vocab_size, target_layer_ids=mla.target_layer_ids,
        markov_rank=mla.markov_rank, mask_token_id=mla.mask_token_id, block_size=block,
        target_hidden_size=mla.target_hidden_size, rms_norm_eps=mla.rms_norm_eps, rope_theta=mla.rope_theta,
        enable_confidence_head=True, confidence_head_with_markov=True, extra=dict(mla.extra))


def config_for(target: ModelConfig, block: int, num_layers: int, seed: int, attention: str) -> AnyDraftConfig:
    if attention not in ("mla", "gqa"):
        raise ValueError(f"draft attention must be mla or gqa, got {attention!r}")
    return (gqa_draft_config_for if attention == "gqa" else draft_config_for)(target, block, num_layers, seed)


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save_draft(model: DSparkDraftModel, cfg: AnyDraftConfig, out: str | Path, note: str) -> Path:
    """Write config.json (with a weights id from the tensors' digest, so two drafts of one shape never
    pass as equal, and retraining from the same seed names the same weights) + weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    config = cfg.to_dict()
    config["kimi_pd_weights_id"] = f"{note}-{weights_digest(tensors)}"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def create_draft_checkpoint(target_dir: str | Path, out: str | Path, block: int, seed: int = 0,
                            num_layers: int = 2, attention: str = "mla") -> Path:
    """A random DSpark draft sized for the target at `target_dir` (block 7 or 5; MLA or GQA attention)."""
    if block not in (5, 7):
        raise ValueError(f"--block must be 7 or 5 (the Block7 / Block5 drafts), got {block}")
    target = ModelConfig.from_file(Path(target_dir) / "config.json")
    cfg = config_for(target, block, num_layers, seed, attention)
    model = draft_model_for(cfg)
    init_weights(model, seed)
    path = save_draft(model, cfg, out, f"random-seed{seed}")
    log.info("wrote random DSpark Block%d %s draft for %s to %s", block, attention, target_dir, path)
    return path


def load_draft(path: str | Path, target: TextConfig, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[DSparkDraftModel, AnyDraftConfig]:
    """Validate and load a draft checkpoint for `target`; raises SpecConfigError naming the problem."""
    path = Path(path)
    cfg = read_draft_config(path)
    cfg.check_target(target)
    file = path / WEIGHTS_FILE
    if not file.exists():
        raise SpecConfigError(f"{path}: no {WEIGHTS_FILE}")
    model = draft_model_for(cfg)
    expected = model.state_dict()
    with safe_open(str(file), framework="pt") as f:
        stored = f.keys()                        # safetensors' safe_open is not iterable: keys() it is
        names = [n for n in stored if not any(n.startswith(s) or f".{s}." in n for s in SHARED_WITH_TARGET)]
        if not cfg.enable_confidence_head:
            names = [n for n in names if not n.startswith("confidence_head.")]
        unknown = sorted(set(names) - set(expected))
        missing = sorted(set(expected) - set(names))
        if unknown:
            raise SpecConfigError(f"{file}: tensor '{unknown[0]}' is not part of this draft's config")
        if missing:
            raise SpecConfigError(f"{file}: tensor '{missing[0]}' is missing" +
                                  (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        state = {}
        for name in names:
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(expected[name].shape):
                raise SpecConfigError(f"{file}: tensor '{name}' has shape {list(t.shape)}, "
                                      f"the config needs {list(expected[name].shape)}")
            state[name] = t
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval(), cfg


def copy_shipped_draft(name: str, out: str | Path) -> Path:
    import shutil
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(shipped_draft(name).iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def draft_identity(path: str | Path) -> str:
    """Names one draft's weights (config incl. weights id): P and D must use the same draft to share its cache."""
    return read_draft_config(path).identity_hash()
