"""ModelSlim W4A8/W8A8_DYNAMIC: packing, quantizers, reference linears, description file, model swap."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.model.quant import (
    FLOAT,
    W4A8_DYNAMIC,
    W8A8_DYNAMIC,
    QuantDescription,
    W4A8DynamicLinear,
    W8A8DynamicLinear,
    _exact_int_matmul,
    apply_quant_description,
    dynamic_quant_per_token_int8,
    pack_int4,
    quant_type_for,
    quantize_int4_per_channel,
    quantize_int8_per_channel,
    quantize_state_dict,
    unpack_int4,
    w4a8_scale_bias,
)
from engine.model.quant_description import MODELSLIM_CONFIG_FILENAME

L = "language_model.model.layers"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# int4 packing
# ---------------------------------------------------------------------------------------------

def test_pack_nibble_order_by_hand() -> None:
    # column 0: row0 = 1 -> low 0x1, row1 = -1 -> high 0xF  => 0xF1 = -15 as int8
    # column 1: row0 = -8 -> low 0x8, row1 = 7 -> high 0x7  => 0x78 = 120
    q = torch.tensor([[1, -8], [-1, 7]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.tolist() == [[-15, 120]]
    assert packed.view(torch.uint8).tolist() == [[0xF1, 0x78]]


def test_pack_unpack_exhaustive_round_trip() -> None:
    pairs = list(itertools.product(range(-8, 8), repeat=2))            # all 256 (even, odd) nibble pairs
    q = torch.tensor(pairs, dtype=torch.int8).T.contiguous()           # [2, 256]
    packed = pack_int4(q)
    assert sorted(packed.view(torch.uint8).flatten().tolist()) == list(range(256))  # a bijection
    assert torch.equal(unpack_int4(packed), q)
    # every byte decodes to the pair it was built from, with multiple packed rows
    q4 = torch.cat([q, q.flip(1)], dim=0)                              # [4, 256]
    assert torch.equal(unpack_int4(pack_int4(q4)), q4)


def test_pack_errors() -> None:
    with pytest.raises(ValueError, match="even number of output rows"):
        pack_int4(torch.zeros(3, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8], [0]], dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[0], [-9]], dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_int4(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int8"):
        unpack_int4(torch.zeros(2, 2))


# ---------------------------------------------------------------------------------------------
# quantizers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantize,qmax", [(quantize_int8_per_channel, 127), (quantize_int4_per_channel, 7)])
def test_weight_quantize_dequantize_error_bound(quantize, qmax: int) -> None:
    w = torch.randn(48, 80, generator=_gen(1)) * torch.logspace(-3, 1, 48).unsqueeze(1)
    w[5] = 0.0                                                         # an all-zero channel
    q, scale, offset = quantize(w)
    assert q.dtype == torch.int8 and scale.dtype == offset.dtype == torch.float32
    assert scale.shape == offset.shape == (48, 1) and not offset.any()
    assert int(q.abs().max()) == qmax                                  # symmetric absmax scale
    assert torch.equal(q.abs().amax(1)[torch.arange(48) != 5], torch.full((47,), qmax, dtype=torch.int8))
    assert not q[5].any() and scale[5].item() == 0.0
    err = (w.double() - q.double() * scale.double()).abs()
    # round-to-nearest: at most half a step, plus fp32 rounding of w / scale
    assert torch.all(err <= scale.double() * (0.5 + 1e-5))


def test_dynamic_per_token_quant() -> None:
    x = torch.randn(2, 5, 64, generator=_gen(2)) * 3
    x[1, 2] = 0.0
    x_q, scale = dynamic_quant_per_token_int8(x)
    assert x_q.dtype == torch.int8 and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 5, 1)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert int(x_q.abs().max()) == 127 and not x_q[1, 2].any()
    assert torch.all((x_q.double() * scale.double() - x.double()).abs() <= scale.double() * (0.5 + 1e-5))
    with pytest.raises(ValueError, match="float"):
        dynamic_quant_per_token_int8(x_q)


def test_scale_bias_documented_value() -> None:
    q = torch.tensor([[1, 2, 3, 4], [-8, 7, 0, -1]], dtype=torch.int8)
    scale = torch.tensor([[0.5], [2.0]])
    # gate/up: one column, 8 * sum_k q * s
    assert torch.equal(w4a8_scale_bias(q, scale, 1), torch.tensor([[8 * 0.5 * 10], [8 * 2.0 * -2]]))
    # down: per input chunk (here 2 chunks of 2 columns)
    assert torch.equal(w4a8_scale_bias(q, scale, 2), torch.tensor([[8 * 0.5 * 3, 8 * 0.5 * 7],
                                                                   [8 * 2.0 * -1, 8 * 2.0 * -1]]))
    with pytest.raises(ValueError, match="divisible"):
        w4a8_scale_bias(q, scale, 3)


# ---------------------------------------------------------------------------------------------
# reference linears
# ---------------------------------------------------------------------------------------------

def _loaded_module(kind: str, w: torch.Tensor, scale_bias_cols: int = 1):
    """A quantized module loaded from a ModelSlim-layout state dict, plus the unpacked q and scale."""
    out_f, in_f = w.shape
    if kind == W8A8_DYNAMIC:
        q, scale, offset = quantize_int8_per_channel(w)
        module = W8A8DynamicLinear(in_f, out_f, params_dtype=torch.float32)
        sd = {"weight": q, "weight_scale": scale, "weight_offset": offset}
    else:
        q, scale, offset = quantize_int4_per_channel(w)
        module = W4A8DynamicLinear(in_f, out_f, scale_bias_cols, params_dtype=torch.float32)
        sd = {"weight": pack_int4(q), "weight_scale": scale, "weight_offset": offset,
              "scale_bias": w4a8_scale_bias(q, scale, scale_bias_cols)}
    module.load_state_dict(sd, strict=True)
    return module, q, scale


def _float64_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized per-token activations @ dequantized weight, all in float64 (no shared matmul code)."""
    x_q, x_scale = dynamic_quant_per_token_int8(x)
    x_deq = x_q.double() * x_scale.double()
    w_deq = q.double() * scale.double()
    return x_deq @ w_deq.T


@pytest.mark.parametrize("kind", [W8A8_DYNAMIC, W4A8_DYNAMIC])
@pytest.mark.parametrize("in_f", [96, 2304])                          # 2304 crosses the 1024 K-chunks
def test_forward_matches_float64_reference(kind: str, in_f: int) -> None:
    w = torch.randn(40, in_f, generator=_gen(3)) * 0.05
    x = torch.randn(7, in_f, generator=_gen(4)) * 4
    module, q, scale = _loaded_module(kind, w)
    y = module(x)
    assert y.dtype == torch.float32 and y.shape == (7, 40)
    # The integer dot product is exact, so the only error is three fp32 roundings of a product
    # (acc -> fp32, * token scale, * channel scale): relative error <= 3 * 2**-24 per element.
    ref = _float64_reference(x, q, scale)
    torch.testing.assert_close(y.double(), ref, rtol=4 * 2.0 ** -24, atol=0.0)


def test_exact_int_matmul_beyond_fp32_integer_range() -> None:
    # |acc| ~ 3000 * 127 * 127 > 2**24 and odd: one plain fp32 GEMM could not return it exactly.
    a = torch.full((3, 3000), 127, dtype=torch.int8)
    b = torch.full((4, 3000), 127, dtype=torch.int8)
    a[1, :100] = -128
    b[0, 7] = 126
    b[2] = -128
    expected = a.long() @ b.long().T
    assert expected.abs().max() > 2 ** 24 and int(expected[0, 0]) % 2 == 1
    acc = _exact_int_matmul(a, b)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), expected)


def test_forward_keeps_input_dtype_and_leading_dims() -> None:
    w = torch.randn(16, 64, generator=_gen(5))
    module, q, scale = _loaded_module(W4A8_DYNAMIC, w, scale_bias_cols=16)
    x = torch.randn(2, 3, 64, generator=_gen(6)).to(torch.bfloat16)
    y = module(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 16)
    ref = _float64_reference(x.reshape(6, 64), q, scale).reshape(2, 3, 16)
    torch.testing.assert_close(y.double(), ref, rtol=2.0 ** -8, atol=0.0)  # one bf16 rounding


# Expected relative (Frobenius) error for N(0,1) data, in=256: each operand's round-to-nearest error is
# step / sqrt(12) with step = absmax / qmax, absmax ~ 3 sigma. int8: ~0.7% per operand, ~1% combined;
# int4 weights: ~12%. Bounds leave ~2x / ~1.5x margin (measured worst over 50 seeds: 1.05% / 13.5%).
@pytest.mark.parametrize("kind,rel_tol", [(W8A8_DYNAMIC, 0.02), (W4A8_DYNAMIC, 0.2)])
def test_forward_close_to_float_linear(kind: str, rel_tol: float) -> None:
    w = torch.randn(64, 256, generator=_gen(7))
    x = torch.randn(16, 256, generator=_gen(8))
    module, _, _ = _loaded_module(kind, w)
    ref = x @ w.T
    rel = ((module(x) - ref).norm() / ref.norm()).item()
    assert rel < rel_tol
    deq_rel = ((module.dequantized_weight() - w).norm() / w.norm()).item()
    assert deq_rel < rel_tol


def test_dequantized_weight_matches_checkpoint_values() -> None:
    w = torch.randn(8, 32, generator=_gen(9))
    module, q, scale = _loaded_module(W4A8_DYNAMIC, w)
    assert module.dequantized_weight().dtype == torch.float32
    assert torch.equal(module.dequantized_weight(), q.float() * scale)
    assert module.dequantized_weight(torch.bfloat16).dtype == torch.bfloat16


def test_module_parameter_layout() -> None:
    w8 = W8A8DynamicLinear(7168, 1536)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in w8.state_dict().items()} == {
        "weight": (torch.int8, (1536, 7168)),
        "weight_scale": (torch.float32, (1536, 1)),
        "weight_offset": (torch.float32, (1536, 1)),
    }
    w4_down = W4A8DynamicLinear(3072, 3584, scale_bias_cols=16)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in w4_down.state_dict().items()} == {
        "weight": (torch.int8, (1792, 3072)),
        "weight_scale": (torch.float32, (3584, 1)),
        "weight_offset": (torch.float32, (3584, 1)),
        "scale_bias": (torch.float32, (3584, 16)),
    }
    with pytest.raises(ValueError, match="odd"):
        W4A8DynamicLinear(16, 5)
    with pytest.raises(ValueError, match="chunks"):
        W4A8DynamicLinear(12, 4, scale_bias_cols=16)


def test_nonzero_offset_is_rejected_on_load() -> None:
    module, q, scale = _loaded_module(W8A8_DYNAMIC, torch.randn(4, 8, generator=_gen(10)))
    sd = module.state_dict()
    sd["weight_offset"] = torch.ones(4, 1)
    with pytest.raises(ValueError, match="weight_offset"):
        module.load_state_dict(sd)
    parent = nn.Module()
    parent.add_module("proj", W8A8DynamicLinear(8, 4))
    with pytest.raises(ValueError, match="weight_offset"):                # also when loaded via a parent
        parent.load_state_dict({f"proj.{k}": v for k, v in sd.items()})


# ---------------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------------

POLICY_TABLE = [
    (f"{L}.1.block_sparse_moe.experts.5.w1.weight", W4A8_DYNAMIC),
    (f"{L}.1.block_sparse_moe.experts.895.w2.weight", W4A8_DYNAMIC),
    (f"{L}.92.block_sparse_moe.experts.0.w3.weight", W4A8_DYNAMIC),
    (f"{L}.0.self_attn.q_proj.weight", W8A8_DYNAMIC),                 # KDA
    (f"{L}.0.self_attn.k_proj.weight", W8A8_DYNAMIC),
    (f"{L}.0.self_attn.v_proj.weight", W8A8_DYNAMIC),
    (f"{L}.0.self_attn.f_a_proj.weight", FLOAT),
    (f"{L}.0.self_attn.f_b_proj.weight", FLOAT),
    (f"{L}.0.self_attn.b_proj.weight", FLOAT),
    (f"{L}.0.self_attn.g_proj.weight", FLOAT),
    (f"{L}.0.self_attn.o_proj.weight", FLOAT),
    (f"{L}.0.self_attn.q_conv1d.weight", FLOAT),
    (f"{L}.0.self_attn.A_log", FLOAT),
    (f"{L}.0.self_attn.dt_bias", FLOAT),
    (f"{L}.0.self_attn.o_norm.weight", FLOAT),
    (f"{L}.3.self_attn.q_a_proj.weight", W8A8_DYNAMIC),               # MLA
    (f"{L}.3.self_attn.q_b_proj.weight", W8A8_DYNAMIC),
    (f"{L}.3.self_attn.kv_a_proj_with_mqa.weight", W8A8_DYNAMIC),
    (f"{L}.3.self_attn.kv_b_proj.weight", FLOAT),
    (f"{L}.3.self_attn.g_proj.weight", FLOAT),
    (f"{L}.3.self_attn.o_proj.weight", FLOAT),
    (f"{L}.3.self_attn.q_a_layernorm.weight", FLOAT),
    (f"{L}.0.mlp.gate_proj.weight", W8A8_DYNAMIC),                    # dense MLP
    (f"{L}.0.mlp.up_proj.weight", W8A8_DYNAMIC),
    (f"{L}.0.mlp.down_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.shared_experts.gate_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.shared_experts.up_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.shared_experts.down_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.routed_expert_down_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.routed_expert_up_proj.weight", W8A8_DYNAMIC),
    (f"{L}.7.block_sparse_moe.routed_expert_norm.weight", FLOAT),
    (f"{L}.7.block_sparse_moe.gate.weight", FLOAT),                    # router
    (f"{L}.7.block_sparse_moe.gate.e_score_correction_bias", FLOAT),
    (f"{L}.7.self_attention_res_proj.weight", FLOAT),
    (f"{L}.7.mlp_res_proj.weight", FLOAT),
    (f"{L}.7.input_layernorm.weight", FLOAT),
    ("language_model.model.embed_tokens.weight", FLOAT),
    ("language_model.model.norm.weight", FLOAT),
    ("language_model.lm_head.weight", FLOAT),
    ("vision_tower.encoder.blocks.0.mlp.fc0.weight", FLOAT),
    ("vision_tower.encoder.blocks.0.mlp.gate_proj.weight", FLOAT),   # only decoder layers are quantized
    ("mm_projector.proj.0.weight", FLOAT),
    ("model.layers.1.block_sparse_moe.experts.2.w2.weight", W4A8_DYNAMIC),   # text-only checkpoint names
    (f"{L}.1.block_sparse_moe.experts.5.w1.weight_scale", FLOAT),    # not a float linear weight
]


@pytest.mark.parametrize("name,expected", POLICY_TABLE)
def test_quant_type_policy(name: str, expected: str) -> None:
    assert quant_type_for(name) == expected


# ---------------------------------------------------------------------------------------------
# description file
# ---------------------------------------------------------------------------------------------

def _w8(prefix: str, qtype: str = W8A8_DYNAMIC) -> dict[str, str]:
    return {f"{prefix}.{s}": qtype for s in ("weight", "weight_scale", "weight_offset")}


def _w4(prefix: str) -> dict[str, str]:
    return {f"{prefix}.{s}": W4A8_DYNAMIC for s in ("weight", "weight_scale", "weight_offset", "scale_bias")}


def test_description_json_round_trip(tmp_path) -> None:
    raw = {**_w8(f"{L}.0.mlp.gate_proj"), **_w8(f"{L}.0.mlp.up_proj"),
           **_w4(f"{L}.1.block_sparse_moe.experts.0.w1"), f"{L}.0.input_layernorm.weight": FLOAT,
           "version": "1.0.0", "model_quant_type": W8A8_DYNAMIC, "group_size": 0,
           "metadata": {"quarot": {"a": 1}}, "optional": {"quarot": {"rotation_map": {"global_rotation": "x"}}},
           "some_future_key": [1, 2]}
    (tmp_path / MODELSLIM_CONFIG_FILENAME).write_text(json.dumps(raw))
    desc = QuantDescription.read(tmp_path)
    assert desc.weight_type(f"{L}.1.block_sparse_moe.experts.0.w1") == W4A8_DYNAMIC
    assert desc.weight_type(f"{L}.0.input_layernorm") == FLOAT
    assert desc.weight_type("not.in.the.file") == FLOAT
    assert desc.optional["quarot"]["rotation_map"]["global_rotation"] == "x"
    assert desc.extra == {"some_future_key": [1, 2]}
    assert desc.to_dict() == raw
    written = desc.write(tmp_path / "out.json")
    assert QuantDescription.read(written) == desc
    assert json.loads(written.read_text()) == raw


def test_description_weight_packed_alias() -> None:
    desc = QuantDescription(tensor_types={f"{L}.0.x.weight_packed": FLOAT})
    assert desc.weight_type(f"{L}.0.x") == FLOAT


@pytest.mark.parametrize("raw,match", [
    ({f"{L}.0.mlp.gate_proj.weight": "W8A8"}, r"'language_model\.model\.layers\.0\.mlp\.gate_proj\.weight'.*'W8A8'"),
    ({f"{L}.3.self_attn.quant_type": "INT8_DYNAMIC"}, r"self_attn\.quant_type.*unsupported"),
    ({**_w8(f"{L}.0.mlp.gate_proj"), "group_size": 128}, "per-channel"),
    ({"fa_quant_type": "FAKQuant"}, "fa_quant_type"),
    ({f"{L}.0.mlp.gate_proj.weight": W8A8_DYNAMIC}, r"gate_proj\.weight_scale.*missing"),
    ({**_w8(f"{L}.0.mlp.gate_proj"), f"{L}.0.mlp.gate_proj.scale_bias": W8A8_DYNAMIC}, "scale_bias"),
    ({**_w8(f"{L}.0.mlp.gate_proj"), f"{L}.0.mlp.gate_proj.weight_offset": FLOAT}, "weight_offset"),
])
def test_description_rejects_bad_files(raw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QuantDescription.from_dict(raw)


def test_description_rejects_disagreeing_fused_shards() -> None:
    moe = f"{L}.1.block_sparse_moe"
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj.*gate_proj\.weight=W8A8_DYNAMIC.*up_proj\.weight=FLOAT"):
        QuantDescription.from_dict({**_w8(f"{L}.0.mlp.gate_proj"), f"{L}.0.mlp.up_proj.weight": FLOAT})
    with pytest.raises(ValueError, match=r"fused_qkv_a_proj"):
        QuantDescription.from_dict({f"{L}.3.self_attn.q_a_proj.weight": FLOAT,
                                    **_w8(f"{L}.3.self_attn.kv_a_proj_with_mqa")})
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts'.*experts\.1\.w2\.weight=W8A8_DYNAMIC"):
        QuantDescription.from_dict({**_w4(f"{moe}.experts.0.w1"), **_w8(f"{moe}.experts.1.w2")})
    # KDA q/k/v are separate layers in vLLM-Ascend: mixing is allowed
    QuantDescription.from_dict({**_w8(f"{L}.0.self_attn.q_proj"), f"{L}.0.self_attn.k_proj.weight": FLOAT})
    desc = QuantDescription.from_dict({**_w8(f"{L}.0.a"), f"{L}.0.b.weight": FLOAT})
    with pytest.raises(ValueError, match=r"a\.weight=W8A8_DYNAMIC, .*b\.weight=FLOAT"):
        desc.fused_type([f"{L}.0.a", f"{L}.0.b"])
    assert desc.fused_type([f"{L}.0.a"]) == W8A8_DYNAMIC


# ---------------------------------------------------------------------------------------------
# checkpoint transform + model swap
# ---------------------------------------------------------------------------------------------

TINY_LINEARS = {                         # module path -> (in, out); the tiny preset's names (docs/model.md)
    f"{L}.0.self_attn.q_proj": (64, 32),
    f"{L}.0.self_attn.f_a_proj": (64, 16),
    f"{L}.0.self_attn.o_proj": (32, 64),
    f"{L}.0.mlp.gate_proj": (64, 128),
    f"{L}.0.mlp.up_proj": (64, 128),
    f"{L}.0.mlp.down_proj": (128, 64),
    f"{L}.0.self_attention_res_proj": (64, 1),
    f"{L}.1.self_attn.q_a_proj": (64, 32),
    f"{L}.1.self_attn.kv_a_proj_with_mqa": (64, 24),
    f"{L}.1.self_attn.kv_b_proj": (16, 64),
    f"{L}.1.block_sparse_moe.routed_expert_down_proj": (64, 32),
    f"{L}.1.block_sparse_moe.routed_expert_up_proj": (32, 64),
    f"{L}.1.block_sparse_moe.shared_experts.gate_proj": (64, 32),
    f"{L}.1.block_sparse_moe.shared_experts.up_proj": (64, 32),
    f"{L}.1.block_sparse_moe.shared_experts.down_proj": (32, 64),
    **{f"{L}.1.block_sparse_moe.experts.{e}.{n}": shape for e in range(2)
       for n, shape in (("w1", (32, 32)), ("w3", (32, 32)), ("w2", (32, 32)))},
    "language_model.lm_head": (64, 256),
}


def _tiny_model(dtype: torch.dtype) -> nn.Module:
    """Plain nn.Linear modules (plus a norm and an embedding) whose paths are checkpoint names."""
    torch.manual_seed(11)
    root = nn.Module()
    leaves: dict[str, nn.Module] = {p: nn.Linear(i, o, bias=False) for p, (i, o) in TINY_LINEARS.items()}
    leaves["language_model.model.embed_tokens"] = nn.Embedding(256, 64)
    leaves[f"{L}.0.input_layernorm"] = nn.LayerNorm(64)
    for path, leaf in leaves.items():
        node = root
        *parents, last = path.split(".")
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.add_module(last, leaf)
    return root.to(dtype)


def test_quantize_state_dict_names_and_description() -> None:
    sd = _tiny_model(torch.bfloat16).state_dict()
    qsd, desc = quantize_state_dict(sd)
    expert = f"{L}.1.block_sparse_moe.experts.0"
    assert {k: (v.dtype, tuple(v.shape)) for k, v in qsd.items() if k.startswith(f"{expert}.w2.")} == {
        f"{expert}.w2.weight": (torch.int8, (16, 32)),
        f"{expert}.w2.weight_scale": (torch.float32, (32, 1)),
        f"{expert}.w2.weight_offset": (torch.float32, (32, 1)),
        f"{expert}.w2.scale_bias": (torch.float32, (32, 16)),
    }
    assert qsd[f"{expert}.w1.scale_bias"].shape == (32, 1)
    assert desc.tensor_types[f"{expert}.w1.scale_bias"] == W4A8_DYNAMIC
    assert desc.tensor_types[f"{L}.0.mlp.down_proj.weight_offset"] == W8A8_DYNAMIC
    assert desc.tensor_types["language_model.lm_head.weight"] == FLOAT
    assert qsd["language_model.lm_head.weight"] is sd["language_model.lm_head.weight"]   # passed through
    assert set(desc.tensor_types) == set(qsd)
    assert (desc.version, desc.model_quant_type, desc.group_size) == ("1.0.0", W8A8_DYNAMIC, 0)
    w1 = sd[f"{expert}.w1.weight"]
    q, scale, _ = quantize_int4_per_channel(w1)
    assert torch.equal(unpack_int4(qsd[f"{expert}.w1.weight"]), q)
    assert torch.equal(qsd[f"{expert}.w1.scale_bias"], w4a8_scale_bias(q, scale, 1))


def test_quantize_state_dict_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="MXFP4"):
        packed = torch.zeros(4, 2, dtype=torch.uint8)
        quantize_state_dict({f"{L}.1.block_sparse_moe.experts.0.w1.weight_packed": packed})
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*2-D float"):
        quantize_state_dict({f"{L}.1.block_sparse_moe.experts.0.w1.weight": torch.zeros(4, 4, dtype=torch.int8)})


def test_state_dict_round_trip_through_apply_and_load(tmp_path) -> None:
    float_model = _tiny_model(torch.float32)
    qsd, desc = quantize_state_dict(float_model.state_dict())
    save_file(qsd, str(tmp_path / "model.safetensors"))                # through the on-disk format
    desc.write(tmp_path)

    model = _tiny_model(torch.float32)
    apply_quant_description(model, QuantDescription.read(tmp_path))
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)

    for path, (in_f, out_f) in TINY_LINEARS.items():
        module, ref_module = model.get_submodule(path), float_model.get_submodule(path)
        qtype = quant_type_for(f"{path}.weight")
        expected_cls = {FLOAT: nn.Linear, W8A8_DYNAMIC: W8A8DynamicLinear, W4A8_DYNAMIC: W4A8DynamicLinear}[qtype]
        assert type(module) is expected_cls, path
        assert (module.in_features, module.out_features) == (in_f, out_f)
        if qtype == FLOAT:
            assert torch.equal(module.weight, ref_module.weight)
            continue
        assert module.params_dtype == torch.float32
        x = torch.randn(5, in_f, generator=_gen(12))
        q = module.int_weight()
        ref = _float64_reference(x, q, module.weight_scale)
        torch.testing.assert_close(module(x).double(), ref, rtol=4 * 2.0 ** -24, atol=0.0)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in qsd.items()}


def test_apply_keeps_device_and_dtype_and_rejects_bias() -> None:
    model = _tiny_model(torch.bfloat16)
    _, desc = quantize_state_dict(model.state_dict())
    apply_quant_description(model, desc)
    expert = model.get_submodule(f"{L}.1.block_sparse_moe.experts.1.w2")
    assert isinstance(expert, W4A8DynamicLinear) and expert.params_dtype == torch.bfloat16
    assert expert.scale_bias.shape == (32, 16) and expert.weight.device.type == "cpu"
    assert isinstance(model.get_submodule(f"{L}.1.block_sparse_moe.experts.1.w1"), W4A8DynamicLinear)
    assert model.get_submodule(f"{L}.1.block_sparse_moe.experts.1.w1").scale_bias.shape == (32, 1)

    biased = nn.Module()
    biased.add_module("proj", nn.Linear(4, 4, bias=True))
    with pytest.raises(ValueError, match="proj: quantized linears with a bias"):
        apply_quant_description(biased, QuantDescription(tensor_types=_w8("proj")))
