"""The GQA (Qwen3-style, RadixArk's layout) DSpark draft: its config as such checkpoints write it, its
refusals, and speculative greedy == plain greedy with it (a random one here; the trained one in
test_tp_spec.py)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.loader import load_checkpoint
from engine.spec_decode.checkpoint import load_draft
from engine.spec_decode.config import GQADraftConfig, SpecConfigError, read_draft_config
from engine.spec_decode.draft_model import GQADraftModel, apply_rope_neox, rope_cos_sin
from tests.engine.spec_decode.conftest import GREEDY, make_llm, prompt_ids, spec, tokens

# The keys a Qwen3 DSpark draft's config.json carries (values scaled down).
QWEN3_STYLE = {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
               "intermediate_size": 128, "vocab_size": 640, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "block_size": 7,
               "markov_rank": 16, "enable_confidence_head": True, "confidence_head_with_markov": True,
               "dflash_config": {"mask_token_id": 600, "target_layer_ids": [1, 3]}, "torch_dtype": "bfloat16"}


def write(tmp_path, **changes) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_STYLE, **changes}))
    return str(tmp_path)


def test_qwen3_style_config_reads_and_round_trips(tmp_path):
    cfg = read_draft_config(write(tmp_path))
    assert isinstance(cfg, GQADraftConfig) and cfg.attention == "gqa"
    assert (cfg.target_layer_ids, cfg.mask_token_id, cfg.block_size) == ((1, 3), 600, 7)
    assert (cfg.target_hidden_size, cfg.num_target_layers, cfg.cache_dim) == (64, 2, 2 * 2 * 16)
    again = GQADraftConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.identity_hash() == cfg.identity_hash()
    model = GQADraftModel(cfg)
    names = set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.self_attn.k_proj.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= names
    assert model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 16.0}}, "only 'default' RoPE"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "missing required key 'mask_token_id'"),
    ({"model_type": "llama"}, "expected 'k3_dspark'"),
])
def test_unsupported_gqa_configs_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(SpecConfigError, match=message):
        read_draft_config(write(tmp_path, **changes))


def test_neox_rope_rotates_halves_and_keeps_norms():
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0)
    y = apply_rope_neox(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[0], x[0])                                      # position 0: no rotation
    expected_first = x[1, :, 0] * cos[1, 0] - x[1, :, 4] * sin[1, 0]            # pairs (i, i + d/2)
    torch.testing.assert_close(y[1, :, 0], expected_first)


def test_random_gqa_draft_loads_for_the_tiny_target_and_greedy_equals_plain(tiny_dir, draft_gqa):
    model, cfg = load_draft(draft_gqa, load_checkpoint(tiny_dir).config.text_config)
    assert isinstance(model, GQADraftModel) and cfg.num_key_value_heads < cfg.num_attention_heads
    prompts = [prompt_ids(9, 1), prompt_ids(23, 2), prompt_ids(4, 3)]
    llm = make_llm(tiny_dir, speculative_config=spec(draft_gqa))
    assert tokens(llm.generate(prompts, GREEDY)) == tokens(make_llm(tiny_dir).generate(prompts, GREEDY))
    assert llm.engine.spec_stats.num_drafts > 0
    llm.engine.check_integrity()


def test_cli_creates_a_gqa_draft_with_the_qwen3_names(tiny_dir, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file
    out = tmp_path / "gqa"
    base = [sys.executable, "-m", "kimi_pd", "checkpoint", "create"]
    subprocess.run([*base, "--draft", "--attention", "gqa", "--target", str(tiny_dir), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["DSparkDraftModel"])
    assert set(config["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
                "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    expected |= {f"layers.{j}.{t}.weight" for j in range(config["num_hidden_layers"]) for t in per_layer}
    assert set(load_file(str(out / "model.safetensors"))) == expected
    refused = subprocess.run([*base, "--attention", "gqa", "--out", str(tmp_path / "x")], capture_output=True,
                             timeout=120)
    assert refused.returncode == 2 and b"add --draft" in refused.stderr


def test_shipped_gqa_draft_is_distilled_for_tiny_chat(tmp_path):
    """`tiny-chat-dspark-gqa` ships like the MLA draft: a preset copy, a GQA config, a trained log."""
    from engine.presets import shipped_checkpoint
    from engine.spec_decode.checkpoint import copy_shipped_draft
    from engine.spec_decode.config import shipped_draft
    out = copy_shipped_draft("tiny-chat-dspark-gqa", tmp_path / "gqa")
    assert (out / "config.json").read_text() == (shipped_draft("tiny-chat-dspark-gqa") / "config.json").read_text()
    model, cfg = load_draft(out, load_checkpoint(shipped_checkpoint("tiny-chat")).config.text_config)
    assert isinstance(cfg, GQADraftConfig) and cfg.num_key_value_heads < cfg.num_attention_heads
    log = json.loads((out / "train_log.json").read_text())
    assert log["config"]["attention"] == "gqa" and log["final_top1"] > 0.8
