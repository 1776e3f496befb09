"""MLA absorbed == materialised, SiTU limits, router selection vs weights."""
from __future__ import annotations

import pytest
import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.layers import situ
from engine.model.mla import MLAOptions
from engine.model.moe import route
from tests.engine.conftest import tiny_model


def _run_mla(layer, cfg, x, pieces):
    cache = HybridCacheTensors.allocate(cfg, num_blocks=8, num_slots=1, block_size=4, dtype=x.dtype)
    table, outs, done = torch.tensor([5, 2, 7, 0, 1, 3, 4, 6]), [], 0      # scattered pages on purpose
    for n in pieces:
        batch = ForwardBatch([SequenceSlice(n, done, 0, table)], cache)
        outs.append(layer(x[done:done + n], batch))
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("pieces", [[13], [5, 8], [1] * 13])
def test_mla_absorbed_equals_materialised(pieces):
    model = tiny_model(dtype=torch.float64)
    cfg = model.config.text_config
    layer = model.language_model.model.layers[cfg.mla_layer_ids[0]].self_attn
    x = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layer.options = MLAOptions(mode="materialized")
    reference = _run_mla(layer, cfg, x, [13])
    layer.options = MLAOptions(mode="absorbed")
    torch.testing.assert_close(_run_mla(layer, cfg, x, pieces), reference, rtol=0, atol=1e-12)
    layer.options = MLAOptions(mode="materialized")
    torch.testing.assert_close(_run_mla(layer, cfg, x, pieces), reference, rtol=0, atol=1e-12)


def test_mla_is_causal():
    model = tiny_model(dtype=torch.float64)
    cfg = model.config.text_config
    layer = model.language_model.model.layers[cfg.mla_layer_ids[0]].self_attn
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x.clone()
    y[4:] += 1.0
    a, b = _run_mla(layer, cfg, x, [6]), _run_mla(layer, cfg, y, [6])
    torch.testing.assert_close(a[:4], b[:4], rtol=0, atol=1e-12)
    assert (a[4:] - b[4:]).abs().max() > 1e-3


def test_situ_tends_to_swiglu_as_beta_grows():
    gen = torch.Generator().manual_seed(0)
    gate = 3 * torch.randn(64, generator=gen, dtype=torch.float64)
    up = 3 * torch.randn(64, generator=gen, dtype=torch.float64)
    swiglu = torch.nn.functional.silu(gate) * up
    errors = [(situ(gate, up, beta, beta * 6) - swiglu).abs().max().item() for beta in (4.0, 40.0, 400.0, 4000.0)]
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > 0.1 and errors[-1] < 1e-4


def test_situ_clips_gate_and_up_ranges():
    big = torch.tensor([1000.0])
    # gate branch saturates at beta, up branch at linear_beta
    assert situ(big, big, 4.0, 25.0).item() == pytest.approx(4.0 * 25.0, rel=1e-6)
    assert situ(big, big, 4.0, None).item() == pytest.approx(4.0 * 1000.0, rel=1e-6)


def test_router_selects_with_bias_but_weights_without():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])                  # makes expert 3 win selection
    weights, ids = route(logits, bias, top_k=2, renormalize=False, scaling=1.0)
    assert sorted(ids[0].tolist()) == [0, 3]
    scores = torch.sigmoid(logits[0])
    assert weights[0, ids[0].tolist().index(3)].item() == pytest.approx(scores[3].item())
    assert weights[0, ids[0].tolist().index(0)].item() == pytest.approx(scores[0].item())


def test_router_renormalises_then_scales():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, torch.zeros(4), top_k=2, renormalize=True, scaling=2.5)
    assert ids[0].tolist() == [0, 1]
    assert weights.sum().item() == pytest.approx(2.5)
    s = torch.sigmoid(logits[0, :2])
    torch.testing.assert_close(weights[0], 2.5 * s / s.sum())
