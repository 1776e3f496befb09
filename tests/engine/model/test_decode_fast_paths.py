"""Decode-step shortcuts (issue 17's batch-1 overhead) give bitwise the values of the general paths.

- `kda_recurrent_step_` (the state updated in place in the cache) == one `kda_recurrent` step;
- a KDA decode over consecutive slots (a cache view, in place) == the gather/scatter over a slot tensor,
  outputs and both cache states;
- the one-token MoE dispatch == the sorted dispatch on the same token, also under expert parallelism;
- `rms_norm` through torch's `F.rms_norm` (inference, fp32/fp64) == the seven-op formula; bf16 keeps the formula;
  float32 in C equals it to rounding.
"""
from __future__ import annotations

import pytest
import torch

from engine.model import decode_ops, gemm, rowdot
from engine.model import moe as moe_module
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kda import _decode_slots
from engine.model.kda_ops import kda_recurrent, kda_recurrent_step_
from engine.model.layers import l2norm, rms_norm
from engine.model.moe import LatentMoE, route
from tests.engine.conftest import kda_layer_and_cache, tiny_model


def test_in_place_recurrent_step_equals_one_recurrent_step():
    gen = torch.Generator().manual_seed(3)
    b, h, k = 3, 4, 16
    q, kk = l2norm(torch.randn(b, h, k, generator=gen)), l2norm(torch.randn(b, h, k, generator=gen))
    v = torch.randn(b, h, k, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(b, h, k, generator=gen))
    beta = torch.sigmoid(torch.randn(b, h, generator=gen))
    state = torch.randn(b, h, k, k, generator=gen)
    ref_o, ref_s = kda_recurrent(q[:, None], kk[:, None], v[:, None], g[:, None], beta[:, None], state, k ** -0.5)
    in_place = state.clone()
    o = kda_recurrent_step_(q, kk, v, g, beta, in_place, k ** -0.5)
    assert torch.equal(o, ref_o[:, 0]) and torch.equal(in_place, ref_s)


def _kda_and_cache(model):
    return kda_layer_and_cache(model, num_slots=6)


@pytest.mark.parametrize("rows", [1, 3])
def test_kda_decode_in_place_over_consecutive_slots_equals_gather_scatter(rows):
    model = tiny_model()
    layer, cache = _kda_and_cache(model)
    other = HybridCacheTensors(block_size=cache.block_size, mla_pages=cache.mla_pages,
                               kda_conv={i: t.clone() for i, t in cache.kda_conv.items()},
                               kda_recurrent={i: t.clone() for i, t in cache.kda_recurrent.items()})
    x = torch.randn(rows, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(9))

    def decode(c: HybridCacheTensors, as_tensor: bool) -> torch.Tensor:
        batch = ForwardBatch([SequenceSlice(1, 5, 2 + r, torch.tensor([0, 1])) for r in range(rows)], c)
        slots = _decode_slots(list(range(rows)), batch, x.device)
        assert isinstance(slots, slice)                   # consecutive slots 2.. are a view
        if as_tensor:
            batch._kda_decode_slots = (list(range(rows)), torch.arange(slots.start, slots.stop))
        with torch.inference_mode():
            return layer(x, batch)

    assert torch.equal(decode(cache, as_tensor=False), decode(other, as_tensor=True))
    lid = layer.layer_id
    assert torch.equal(cache.kda_conv[lid], other.kda_conv[lid])
    assert torch.equal(cache.kda_recurrent[lid], other.kda_recurrent[lid])


@pytest.mark.parametrize("expert_range", [None, (2, 6)])
def test_one_token_moe_equals_sorted_dispatch(expert_range):
    model = tiny_model()
    model.fuse_linears()
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    moe.expert_range = expert_range
    gen = torch.Generator().manual_seed(11)
    latent = moe.routed_expert_down_proj.weight.shape[0]
    for _ in range(20):
        h = torch.randn(1, latent, generator=gen)
        logits = torch.randn(1, len(moe.experts), generator=gen)
        # 4 of them (the tiny preset routes 2): with 3 or more terms the order of the sum shows
        weights, ids = route(logits, moe.gate.e_score_correction_bias, 4, moe.renormalize, moe.scaling)
        fast = moe._routed_dispatch(h, weights, ids)
        assert torch.equal(fast, moe._sorted_dispatch(h, weights, ids))


@pytest.mark.skipif(rowdot.kernel() is None, reason="the rowdot kernel does not run here (no cc, no AVX-512F or AVX2)")
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_experts_in_one_kernel_call_equal_one_linear_per_expert(monkeypatch, one_thread, tokens):
    """The chosen experts' products in one rowdot call per weight kind (`gemm.grouped_kernel`) give
    bitwise what one `linear` per expert gives: one token (4 experts), and 8 tokens routed so that one
    expert takes all 8 rows (more than `rowdot.row_major_max_rows()`: that group stays on `linear`)."""
    monkeypatch.setattr(gemm, "ONEDNN_MIN_WEIGHT_ELEMENTS", 1)       # the tiny experts count as large
    model = tiny_model()
    model.fuse_linears()
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    gen = torch.Generator().manual_seed(13)
    latent, experts = moe.routed_expert_down_proj.weight.shape[0], len(moe.experts)
    grouped_calls = []
    real_run, real_kernel = rowdot.Kernel._run, moe_module.grouped_kernel
    monkeypatch.setattr(rowdot.Kernel, "_run", lambda self, *a: grouped_calls.append(a[2]) or real_run(self, *a))
    use_kernel = True
    monkeypatch.setattr(moe_module, "grouped_kernel", lambda x, w: real_kernel(x, w) if use_kernel else None)
    with torch.inference_mode():
        for _ in range(10):
            h = torch.randn(tokens, latent, generator=gen)
            logits = torch.randn(tokens, experts, generator=gen)
            logits[:, 0] += 10.0                          # every token picks expert 0
            weights, ids = route(logits, moe.gate.e_score_correction_bias, 4, moe.renormalize, moe.scaling)
            use_kernel = True
            grouped = moe._routed_dispatch(h, weights, ids)
            use_kernel = False
            assert torch.equal(grouped, moe._routed_dispatch(h, weights, ids))
    assert len(grouped_calls) == 20                          # two kernel calls a layer call: w1|w3, then w2


C_NORM = decode_ops.decode_ops() is not None


@pytest.mark.parametrize("shape", [(1, 1024), (5, 64), (2, 3, 128)])
@pytest.mark.parametrize("dtype, c_norm", [(torch.float32, False), (torch.float64, False), (torch.float32, C_NORM)])
def test_rms_norm_is_the_formula(monkeypatch, dtype, shape, c_norm):
    """Torch's fused call is the formula bitwise; float32 in C (engine/model/decode_ops.py, where its
    library loads; the C norm runs float32 only) to rounding."""
    if not c_norm:
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 7).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    same = torch.testing.assert_close if c_norm else lambda a, b: assert_equal(a, b)
    with torch.inference_mode():                     # the fused call is for inference (training keeps the formula)
        same(rms_norm(x, w, 1e-5), ref)
        same(rms_norm(x, None, 1e-5), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        same(rms_norm(x[..., 1:], w[1:], 1e-5), w[1:] * (x[..., 1:] * torch.rsqrt(   # strided rows
            x[..., 1:].pow(2).mean(-1, keepdim=True) + 1e-5)))


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b)


def test_rms_norm_of_bf16_multiplies_the_weight_in_fp32():
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(64)
    xf = x.float()
    reference = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, w, 1e-5), reference.bfloat16())
