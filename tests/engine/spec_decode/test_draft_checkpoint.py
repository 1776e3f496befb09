"""Draft checkpoints: the k3_dspark layout (docs/dspark.md 3.1/3.3), the CLI, the validating loader."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.spec_decode.checkpoint import load_draft
from engine.spec_decode.config import DraftConfig, SpecConfigError
from shared.model_config import ModelConfig

LAYER_TENSORS = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_proj.weight",
                 "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


@pytest.mark.parametrize("block", [7, 5])
def test_cli_creates_loadable_k3_dspark_draft(tiny_dir, tmp_path, block):
    out = tmp_path / f"draft{block}"
    cmd = [sys.executable, "-m", "kimi_pd", "checkpoint", "create", "--draft", "--target", str(tiny_dir),
           "--block", str(block), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "k3_dspark" and config["block_size"] == block
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert not any(config[k] for k in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"))
    assert config["num_target_layers"] == len(config["target_layer_ids"]) and config["sample_from_anchor"]
    assert config["draft_vocab_size"] == config["vocab_size"]
    names = set(load_file(str(out / "model.safetensors")))
    expected = {"context_proj.weight", "context_norm.weight", "final_norm.weight", "markov_head.markov_w1.weight",
                "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    expected |= {f"layers.{j}.{t}" for j in range(config["num_hidden_layers"]) for t in LAYER_TENSORS}
    assert names == expected
    target = ModelConfig.from_file(tiny_dir).text_config
    model, cfg = load_draft(out, target)
    assert model.markov_head.markov_w1.weight.shape == (target.vocab_size, cfg.markov_rank)
    assert model.context_proj.weight.shape == (cfg.hidden_size, target.hidden_size * len(cfg.target_layer_ids))


def test_loader_names_the_problem(tiny_dir, draft7, tmp_path):
    target = ModelConfig.from_file(tiny_dir).text_config
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((draft7 / "config.json").read_text())
    tensors = load_file(str(draft7 / "model.safetensors"))

    def write(cfg, ts):
        (bad / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(bad / "model.safetensors"))

    write({**config, "mla_use_nope": True}, tensors)
    with pytest.raises(SpecConfigError, match="mla_use_nope"):
        load_draft(bad, target)
    write({**config, "target_layer_ids": [1, 9]}, tensors)
    with pytest.raises(SpecConfigError, match="num_target_layers|outside"):
        load_draft(bad, target)
    write(config, {k: v for k, v in tensors.items() if k != "final_norm.weight"})
    with pytest.raises(SpecConfigError, match="final_norm.weight' is missing"):
        load_draft(bad, target)
    write(config, {**tensors, "layers.0.mlp.gate_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(SpecConfigError, match="has shape"):
        load_draft(bad, target)
    write(config, {**tensors, "embed_tokens.weight": torch.zeros(3, 3), "lm_head.weight": torch.zeros(3, 3)})
    load_draft(bad, target)                                # shared with the target: ignored, as vLLM does
    write({**config, "hidden_size": 32}, tensors)
    with pytest.raises(SpecConfigError, match="hidden_size"):
        load_draft(bad, target)


def test_mask_token_lookup_order():
    base = json.loads(json.dumps({"model_type": "k3_dspark", "hidden_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "q_lora_rank": 4, "kv_lora_rank": 4,
                                  "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
                                  "intermediate_size": 8, "vocab_size": 100, "target_layer_ids": [0],
                                  "num_target_layers": 1, "target_hidden_size": 8, "markov_rank": 2,
                                  "block_size": 7}))
    assert DraftConfig.from_dict({**base, "ptd_token_id": 5, "pard_token": 4}).mask_token_id == 4
    assert DraftConfig.from_dict({**base, "dflash_config": {"mask_token_id": 3}, "mask_token_id": 9}).mask_token_id == 3
    with pytest.raises(SpecConfigError, match="mask_token_id"):
        DraftConfig.from_dict(base)
