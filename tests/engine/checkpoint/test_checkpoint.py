"""Generated checkpoints: layout, determinism, round trip, and clear errors for broken ones."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.create import create_checkpoint, generated_state_dict
from engine.checkpoint.layout import INDEX_FILE, QUANT_DESCRIPTION_FILE, SINGLE_FILE
from engine.checkpoint.loader import CheckpointError, load_checkpoint
from engine.model.sequence_runner import SequenceRunner
from engine.presets import preset_config
from shared.model_config import ConfigError, ModelConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return create_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False)


@pytest.fixture()
def broken_copy(tiny_dir, tmp_path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(tiny_dir, dst)
    return dst


def _rewrite_tensor(ckpt: Path, name: str, new: torch.Tensor | None) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    fname = index["weight_map"][name]
    tensors = load_file(str(ckpt / fname))
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new
    save_file(tensors, str(ckpt / fname))


def test_layout_has_real_k3_keys_and_files(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = config["text_config"]
    for key in ("linear_attn_config", "kv_lora_rank", "qk_rope_head_dim", "routed_expert_hidden_size",
                "attn_res_block_size", "activation_situ_beta", "num_experts_per_token", "moe_renormalize"):
        assert key in text
    index = json.loads((tiny_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 2                 # really sharded
    for f in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_dir / f).exists()
    names = set(index["weight_map"])
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "language_model.lm_head.weight" in names and "mm_projector.proj.0.weight" in names
    assert load_file(str(tiny_dir / index["weight_map"]["language_model.model.layers.0.self_attn.A_log"]))[
        "language_model.model.layers.0.self_attn.A_log"][2:].abs().sum() == 0   # padded like K3


def test_round_trip_is_exact_and_deterministic(tiny_dir):
    model = load_checkpoint(tiny_dir)
    expected = generated_state_dict(preset_config("tiny"), seed=0)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    other = generated_state_dict(preset_config("tiny"), seed=1)
    assert not torch.equal(other["language_model.lm_head.weight"], expected["language_model.lm_head.weight"])



def test_single_file_checkpoint_loads(broken_copy):
    """An unsharded checkpoint (one model.safetensors, no index) loads the same weights as the sharded one."""
    index = json.loads((broken_copy / INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for fname in sorted(set(index.values())):
        tensors.update(load_file(str(broken_copy / fname)))
        (broken_copy / fname).unlink()
    (broken_copy / INDEX_FILE).unlink()
    save_file(tensors, str(broken_copy / SINGLE_FILE))
    loaded = load_checkpoint(broken_copy).state_dict()
    expected = generated_state_dict(preset_config("tiny"), seed=0)
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())

def test_bf16_load_tracks_fp32(tiny_dir):
    ids = torch.arange(100, 130)
    fp32 = SequenceRunner(load_checkpoint(tiny_dir), 64).feed(ids)
    bf16_model = load_checkpoint(tiny_dir, dtype=torch.bfloat16)
    assert bf16_model.language_model.model.layers[0].self_attn.A_log.dtype == torch.float32
    bf16 = SequenceRunner(bf16_model, 64).feed(ids)
    # bf16 keeps 8 mantissa bits (~4e-3); a near-tie in MoE routing can flip an expert for one token,
    # so the bound is on the mean error, not the max.
    assert ((bf16 - fp32).abs().mean() / fp32.abs().mean()).item() < 0.05
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean().item() > 0.8


def test_missing_tensor_is_named(broken_copy):
    _rewrite_tensor(broken_copy, "language_model.model.layers.2.self_attn.b_proj.weight", None)
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.b_proj\.weight.*not in the file"):
        load_checkpoint(broken_copy)


def test_tensor_missing_from_index_is_named(broken_copy):
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    del index["weight_map"]["language_model.model.norm.weight"]
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"language_model\.model\.norm\.weight' is missing"):
        load_checkpoint(broken_copy)


def test_wrong_shape_message(broken_copy):
    _rewrite_tensor(broken_copy, "language_model.model.layers.3.self_attn.q_b_proj.weight", torch.zeros(40, 32))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(broken_copy)
    assert "q_b_proj.weight' has shape [40, 32], the config needs [48, 32]" in str(err.value)
    assert ".safetensors" in str(err.value)


def test_wrongly_typed_tensor_is_named(broken_copy):
    _rewrite_tensor(broken_copy, "language_model.lm_head.weight", torch.zeros(1280, 64, dtype=torch.int8))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight' has dtype torch\.int8, expected a floating dtype"):
        load_checkpoint(broken_copy)


def test_unknown_tensor_is_named(broken_copy):
    _rewrite_tensor(broken_copy, "language_model.model.layers.0.mlp.gate_proj.weight", torch.zeros(128, 64))
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    fname = index["weight_map"]["language_model.lm_head.weight"]
    tensors = load_file(str(broken_copy / fname))
    tensors["language_model.model.layers.0.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(broken_copy / fname))
    index["weight_map"]["language_model.model.layers.0.surprise.weight"] = fname
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"surprise\.weight' is not part of this model"):
        load_checkpoint(broken_copy)


def test_missing_shard_is_named(broken_copy):
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    (broken_copy / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(CheckpointError, match="shard listed in the index is missing"):
        load_checkpoint(broken_copy)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["text_config"].pop("kv_lora_rank"), "missing required key 'kv_lora_rank'"),
    (lambda c: c["text_config"].update(hidden_size="64"), r"hidden_size: expected int, got str"),
    (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3]), "missing \\[5\\]"),
    (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]), "both KDA and full"),
    (lambda c: c.update(model_type="llama"), "expected 'kimi_k3'"),
    (lambda c: c.update(eos_token_id=99999), "outside the vocabulary"),
    (lambda c: c["text_config"].update(num_experts_per_token=99), "num_experts_per_token"),
])
def test_bad_config_is_a_clear_error(broken_copy, mutate, message):
    config = json.loads((broken_copy / "config.json").read_text())
    mutate(config)
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(broken_copy)


def test_config_round_trips_and_keeps_unknown_keys():
    raw = preset_config("tiny").to_dict()
    raw["transformers_version"] = "4.99"
    raw["text_config"]["auto_map"] = {"AutoConfig": "x"}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.to_dict() == raw
    assert cfg.identity_hash() == ModelConfig.from_dict(json.loads(json.dumps(raw))).identity_hash()
    with pytest.raises(ConfigError):
        ModelConfig.from_dict([])


def test_w4a8_checkpoint_loads_and_tracks_its_dequantized_reference(tmp_path):
    """Quantized forward (per-token int8 activations) vs the same weights dequantized, float activations.

    Tolerance: int8 per-token activation quantization costs ~1% per linear; through the tiny model's
    6 layers the mean logit error stays under 10% of the mean |logit| (a flipped MoE expert can move
    single logits further, so the bound is on the mean), and most greedy picks agree.
    """
    from engine.model.quant import W4A8DynamicLinear, W8A8DynamicLinear
    ckpt = create_checkpoint("tiny", tmp_path / "w4a8", seed=0, quant="w4a8", progress=False)
    assert (ckpt / QUANT_DESCRIPTION_FILE).exists()
    quantized = load_checkpoint(ckpt)
    kinds = {type(m) for m in quantized.modules()}
    assert W4A8DynamicLinear in kinds and W8A8DynamicLinear in kinds
    reference = load_checkpoint(ckpt)
    for module in list(reference.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (W4A8DynamicLinear, W8A8DynamicLinear)):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight.data = child.dequantized_weight(torch.float32)
                setattr(module, child_name, linear)
    ids = torch.arange(200, 232)
    q = SequenceRunner(quantized, 64).feed(ids)
    r = SequenceRunner(reference, 64).feed(ids)
    assert ((q - r).abs().mean() / r.abs().mean()).item() < 0.10
    assert (q.argmax(-1) == r.argmax(-1)).float().mean().item() >= 0.75
    # and the quantized model is itself self-consistent: prefill == token-by-token decode
    runner = SequenceRunner(quantized, 64)
    steps = torch.cat([runner.feed(ids[i:i + 1]) for i in range(ids.numel())])
    assert ((steps - q).abs().max() / q.abs().max()).item() < 1e-5


def test_quantize_command_equals_quantized_create(tiny_dir, tmp_path):
    """The standalone bf16 -> W4A8 transform gives the same tensors as `create --quant w4a8`."""
    from engine.checkpoint.quantize import quantize_checkpoint
    transformed = quantize_checkpoint(tiny_dir, tmp_path / "q", progress=False)
    created = create_checkpoint("tiny", tmp_path / "c", seed=0, quant="w4a8", progress=False)
    a, b = load_checkpoint(transformed).state_dict(), load_checkpoint(created).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((transformed / QUANT_DESCRIPTION_FILE).read_text()) == \
        json.loads((created / QUANT_DESCRIPTION_FILE).read_text())
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(transformed, tmp_path / "again", progress=False)
