"""Fused linears (engine/model/fused.py): linears reading one input run as one GEMM after loading.

- through the engine, a fused model gives the unfused model's logits step by step (prefill, chunked
  prefill, batched decode, the capture-safe static decode step) within 1e-12 in fp64, and the same
  greedy tokens in fp32; a W4A8/W8A8 checkpoint fused is bit-identical to unfused (exact int products);
- the checkpoint's parameters stay, as views of the fused storage: same names, same bytes (nothing
  counted twice), and an in-place `load_state_dict` reaches the fused GEMM;
- mixed kinds fuse per kind (the float linears of a quantized set stay alone), and a chunk spanning
  kinds is concatenated.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.graphs.config import CompilationConfig
from engine.graphs.decode import EagerReplay, enable_decode_replay
from engine.model.fused import FusedProjections, fuse_linears, is_fused, project
from engine.model.quant import (
    W4A8DynamicLinear,
    W8A8DynamicLinear,
    pack_int4,
    quantize_int4_per_channel,
    quantize_int8_per_channel,
)
from tests.engine.core.helpers import record_step_logits

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=24,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2)
# a 30-token prompt takes two chunks (24-token steps); the batch decodes 4, then 3 rows
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(1, 9), (2, 14), (3, 5), (4, 30)]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 10, 4, 8)]






def run(model_dir, fused: bool, dtype: str, static: bool = False):
    llm = LLM(str(model_dir), dtype=dtype, **SETTINGS)
    model = llm.engine.model
    if not fused:
        model.unfuse_linears()
    assert any(is_fused(m) for m in model.modules()) == fused
    if static:
        enable_decode_replay(llm.engine.runner, model, 8, CompilationConfig("FULL_DECODE_ONLY"),
                             lambda step, make_inputs: EagerReplay(step))
    logits = record_step_logits(llm.engine.runner)
    tokens = [o.output.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    llm.engine.check_integrity()
    return tokens, logits


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b, strict=False))
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-decode"])
def test_fused_equals_unfused_fp64(tiny_dir, static):
    ref_tokens, ref_logits = run(tiny_dir, fused=False, dtype="float64", static=static)
    tokens, logits = run(tiny_dir, fused=True, dtype="float64", static=static)
    assert tokens == ref_tokens
    assert max_diff(logits, ref_logits) < 1e-12


def test_fused_greedy_tokens_equal_fp32(tiny_dir):
    assert run(tiny_dir, fused=True, dtype="float32")[0] == run(tiny_dir, fused=False, dtype="float32")[0]


def test_fused_quantized_checkpoint_is_bit_identical(tiny_w4a8_dir):
    ref_tokens, ref_logits = run(tiny_w4a8_dir, fused=False, dtype="float32")
    tokens, logits = run(tiny_w4a8_dir, fused=True, dtype="float32")
    assert tokens == ref_tokens
    assert max_diff(logits, ref_logits) == 0.0
    llm = LLM(str(tiny_w4a8_dir), **SETTINGS)
    kinds = {type(m).__name__ for owner in llm.engine.model.modules() if is_fused(owner)
             for m in owner.__dict__["_fused_projections"].groups}
    assert {"W4A8DynamicLinear", "W8A8DynamicLinear"} <= kinds            # experts w1|w3, KDA q|k|v
    assert all(is_fused(e) for e in experts(llm.engine.model))           # every expert, not just the first


def test_parameters_stay_as_views_of_the_fused_weights(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float64", **SETTINGS)
    model = llm.engine.model
    fused_state = {k: v.clone() for k, v in model.state_dict().items()}
    llm.engine.model.unfuse_linears()
    from engine.checkpoint.loader import load_checkpoint
    plain = load_checkpoint(tiny_dir, torch.float64)
    assert list(fused_state) == list(plain.state_dict())                 # the checkpoint's names
    assert all(torch.equal(fused_state[k], v) for k, v in plain.state_dict().items())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    model.fuse_linears()
    assert all(is_fused(e) for e in experts(model))
    kda = model.language_model.model.layers[1].self_attn
    merged = kda.__dict__["_fused_projections"].groups[0].weight
    assert kda.q_proj.weight.data_ptr() == merged.data_ptr()
    assert kda.g_proj.weight.data_ptr() == merged[-kda.g_proj.weight.shape[0]:].data_ptr()
    # an in-place load reaches the fused GEMM: zeroing g_proj zeroes that slice of the fused output
    model.load_state_dict({**model.state_dict(), "language_model.model.layers.1.self_attn.g_proj.weight":
                           torch.zeros_like(kda.g_proj.weight)})
    x = torch.randn(3, kda.q_proj.weight.shape[1], dtype=torch.float64)
    assert torch.equal(project(kda, x, kda._input_linears(), (3, 1, 1, 1))[3],
                       torch.zeros(3, kda.g_proj.weight.shape[0], dtype=torch.float64))


def experts(model) -> list[nn.Module]:
    return [e for layer in model.language_model.model.layers if hasattr(layer, "block_sparse_moe")
            for e in layer.block_sparse_moe.experts]


def _w8a8(w: torch.Tensor) -> W8A8DynamicLinear:
    q, scale, offset = quantize_int8_per_channel(w)
    m = W8A8DynamicLinear(w.shape[1], w.shape[0], params_dtype=torch.float32)
    m.weight.data, m.weight_scale.data, m.weight_offset.data = q, scale, offset
    return m


def _w4a8(w: torch.Tensor) -> W4A8DynamicLinear:
    q, scale, offset = quantize_int4_per_channel(w)
    m = W4A8DynamicLinear(w.shape[1], w.shape[0], params_dtype=torch.float32)
    m.weight.data, m.weight_scale.data, m.weight_offset.data = pack_int4(q), scale, offset
    return m


def _linear(w: torch.Tensor) -> nn.Linear:
    m = nn.Linear(w.shape[1], w.shape[0], bias=False)
    m.weight.data = w.clone()
    return m


def test_mixed_kinds_fuse_per_kind_and_chunks_match():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 32, generator=g) for n in (6, 10, 4, 8, 2)]
    members = [_w8a8(ws[0]), _w8a8(ws[1]), _linear(ws[2]), _w4a8(ws[3]), _linear(ws[4])]
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        expected = [m(x) for m in members]
        owner = nn.Module()
        assert fuse_linears(owner, members, (2, 1, 2))          # w8a8|w8a8, float, w4a8|float (mixed chunk)
        fused = owner.__dict__["_fused_projections"]
        # one GEMM for the two W8A8 linears; W4A8 alone; the float ones of a quantized set keep their own
        assert isinstance(fused, FusedProjections) and len(fused.groups) == 4
        got = project(owner, x, members, (2, 1, 2))
        assert torch.equal(got[0], torch.cat(expected[:2], -1))
        assert torch.equal(got[2], torch.cat(expected[3:], -1))
        assert torch.equal(got[1], expected[2])
        same = [torch.equal(m(x), e) for m, e in zip(members, expected, strict=False)]
        assert same == [True] * 5                                       # views, same values


def test_unfusable_members_are_left_alone():
    owner = nn.Module()
    members = [nn.Linear(4, 2, bias=True), nn.Linear(4, 2, bias=False)]
    assert not fuse_linears(owner, members, (1, 1)) and not is_fused(owner)
