"""Whole-layer decode calls in C (engine/model/decode_ops.py) give bitwise what the Python path gives.

- a KDA layer's decoding tokens after its input projections (`kda_rows`, 1 to 8 sequences) == the Python
  path, outputs and both cache states, over several steps; the gated output norm in C == its torch form
  to rounding; verification, a reset state or a prefill in the step keep the Python path;
- a latent MoE layer on a decode step's tokens (`moe_rows`, 1 to 16 rows) == `LatentMoE.forward` with the
  whole-layer calls off, with and without shared experts and the latent norm, over many inputs (so many
  expert choices);
- the plan declines where the C call would not reproduce the Python path (small weights on MKL, expert
  parallelism, a forward on more threads, more rows than the rowdot kernels take) and the Python path runs;
- a gated MLA layer's decoding tokens (`mla_rows`, 1 to 8 sequences over scattered pages) == the Python
  path, outputs and pages, over steps that attend to the latents the previous ones wrote; the output
  gate in C == its torch form to rounding;
- a layer's AttnRes mixing and norm in one call == the two calls;
- a whole model decoding token by token with the whole-layer calls == without them, logits bitwise;
(`KIMI_PD_CPU_DECODE_LAYERS=0` is tested beside `KIMI_PD_CPU_DECODE_OPS=0` in test_decode_ops.py.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import pytest
import torch

from engine.checkpoint.init import init_weights
from engine.model import attnres, decode_ops
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kda import KDAOptions, KimiDeltaAttention
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration, ModelOptions
from engine.model.layers import rms_norm
from engine.model.mla import GatedMLA, MLAOptions
from engine.model.moe import LatentMoE
from engine.model.sequence_runner import SequenceRunner
from engine.presets import preset_config
from tests.engine.conftest import tiny_model

T = TypeVar("T")
needs_ops = pytest.mark.skipif(decode_ops.decode_ops() is None, reason="no C compiler / not x86-64 Linux / no AVX2")


def _moe(shared: int = 1, norm: bool = True, seed: int = 0) -> LatentMoE:
    """A latent MoE whose linears are all large enough for the rowdot kernels (at least 128K elements)."""
    cfg = replace(preset_config("tiny").text_config, hidden_size=512, num_experts=8, num_experts_per_token=3,
                  moe_intermediate_size=512, routed_expert_hidden_size=256, num_shared_experts=shared,
                  latent_moe_use_norm=norm)
    moe = LatentMoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    moe.fuse_linears()
    return moe.eval()


def _count_calls(monkeypatch, name: str = "moe_rows") -> list[int]:
    """Completed calls of the C entry `name` (a `moe_rows` call that asks for expert panel copies first
    computes nothing and is not counted)."""
    ops = decode_ops.decode_ops()
    calls: list[int] = []
    real = getattr(ops, name)

    def counting(*args):
        result = real(*args)
        if not result:
            calls.append(1)
        return result

    monkeypatch.setattr(ops, name, counting)
    return calls


def _wide_text():
    """The tiny preset's text config with every KDA, MLA and MoE linear large enough for the rowdot kernels
    (at least 128K elements; the small ones, KDA's f_b_proj and layer 0's dense MLP, stay on MKL)."""
    tiny = preset_config("tiny").text_config
    return replace(tiny, hidden_size=512, linear_attn_config=replace(tiny.linear_attn_config, num_heads=8, head_dim=64),
                   num_experts=8, num_experts_per_token=3, moe_intermediate_size=512, routed_expert_hidden_size=256,
                   num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=128,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if name in ("A_log", "dt_bias") else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _kda(seed: int = 0) -> tuple[KimiDeltaAttention, object]:
    """A KDA layer whose input projections and o_proj are large enough for the rowdot kernels, and its config."""
    cfg = _wide_text()
    layer_id = next(i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    layer = KimiDeltaAttention(cfg, layer_id, KDAOptions())
    _randomize(layer, seed)
    layer.fuse_linears()
    return layer.eval(), cfg


def _kda_cache(cfg, layer_id: int) -> HybridCacheTensors:
    cache = HybridCacheTensors.allocate(cfg, num_blocks=4, num_slots=9, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    for store in (cache.kda_conv[layer_id], cache.kda_recurrent[layer_id]):
        store.copy_(torch.randn(store.shape, generator=gen) * 0.3)
    return cache


def _clone(cache: HybridCacheTensors) -> HybridCacheTensors:
    return HybridCacheTensors(block_size=cache.block_size, mla_pages={i: t.clone() for i, t in cache.mla_pages.items()},
                              kda_conv={i: t.clone() for i, t in cache.kda_conv.items()},
                              kda_recurrent={i: t.clone() for i, t in cache.kda_recurrent.items()})


@needs_ops
@pytest.mark.parametrize("slots", [(3,), (4, 1, 5), (5, 4, 3, 2, 1, 0, 6, 7)])
def test_kda_rows_in_c_equal_the_python_path_bitwise(monkeypatch, one_thread, slots):
    layer, cfg = _kda()
    lid = layer.layer_id
    in_c = _kda_cache(cfg, lid)
    python = _clone(in_c)
    calls = _count_calls(monkeypatch, "kda_rows")
    gen = torch.Generator().manual_seed(2)
    table = torch.tensor([0, 1])
    with torch.inference_mode():
        for step in range(6):                     # the states carry over: each step reads the last one's
            x = torch.randn(len(slots), 512, generator=gen) * (1 + step % 3)
            batch = [SequenceSlice(1, 5 + step, slot, table) for slot in slots]
            want, got = _off_then_on(lambda on, x=x, batch=batch: layer(x, ForwardBatch(batch, in_c if on else python)))
            assert torch.equal(got, want), (step, (got - want).abs().max())
            assert torch.equal(in_c.kda_conv[lid], python.kda_conv[lid])
            assert torch.equal(in_c.kda_recurrent[lid], python.kda_recurrent[lid])
    assert len(calls) == 6
    assert not torch.equal(in_c.kda_recurrent[lid][slots[0]], _kda_cache(cfg, lid).kda_recurrent[lid][slots[0]])


@needs_ops
@pytest.mark.parametrize("case", ["a prefill beside", "verification", "reset"])
def test_kda_rows_keep_the_python_path_elsewhere(monkeypatch, one_thread, case):
    layer, cfg = _kda()
    cache = _kda_cache(cfg, layer.layer_id)
    calls = _count_calls(monkeypatch, "kda_rows")
    table = torch.tensor([0, 1])
    slices = {"a prefill beside": [SequenceSlice(1, 5, 2, table), SequenceSlice(3, 0, 3, table)],
              "verification": [SequenceSlice(3, 5, 2, table, spec_slots=(4, 5))],
              "reset": [SequenceSlice(1, 0, 2, table, reset_kda_state=True)]}[case]
    rows = sum(s.num_new_tokens for s in slices)
    with torch.inference_mode():
        layer(torch.randn(rows, 512), ForwardBatch(slices, cache))
    assert not calls


@needs_ops
def test_gated_norm_in_c_equals_the_torch_form():
    ops = decode_ops.decode_ops()
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 3, 64, generator=gen) * 3, torch.randn(64, generator=gen)
    wide = torch.randn(5, 3 * 64 + 7, generator=gen) * 4
    gate = wide[:, 7:].view(5, 3, 64)                    # rows strided, as a view of a fused projection
    got = ops.gated_rms_norm(x, w, 1e-5, gate)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double() * torch.sigmoid(gate.double())
    torch.testing.assert_close(got.double(), want, rtol=4e-6, atol=1e-6)
    assert ops.gated_rms_norm(x.transpose(0, 1), w, 1e-5, gate.transpose(0, 1)) is None     # not contiguous


def _off_then_on(run: Callable[[bool], T]) -> tuple[T, T]:
    """`run(on)` with the whole-layer calls off, then on: (the Python path's result, the C calls')."""
    with torch.inference_mode():
        decode_ops.set_layers_enabled(False)
        try:
            python = run(False)
        finally:
            decode_ops.set_layers_enabled(True)
        return python, run(True)


@needs_ops
@pytest.mark.parametrize("shared, norm, rows", [(1, True, 1), (0, True, 1), (2, False, 1), (1, True, 2),
                                                (0, False, 5), (1, True, 16)])
def test_moe_rows_in_c_equal_the_python_path_bitwise(monkeypatch, one_thread, shared, norm, rows):
    """One row: every product on the row-major kernel; more: the panels, and experts that several rows
    chose on their panel copies (made the first time, then kept)."""
    moe = _moe(shared, norm)
    calls = _count_calls(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    chosen = set()
    for i in range(12):
        x = torch.randn(rows, 512, generator=gen) * (1 + i % 4)
        python, in_c = _off_then_on(lambda on, x=x: moe(x))
        assert torch.equal(python, in_c), (i, (python - in_c).abs().max())
        with torch.inference_mode():
            chosen.add(tuple(moe.gate.logits(x[:1]).topk(3).indices[0].tolist()))
    assert len(calls) == 12
    assert len(chosen) > 3                               # different expert sets were compared


@needs_ops
def test_moe_rows_decline_where_they_would_not_reproduce_the_python_path(monkeypatch, one_thread):
    calls = _count_calls(monkeypatch)
    small = tiny_model()                                 # every weight under 128K elements: MKL's products
    small.fuse_linears()
    tiny_moe = next(m for m in small.modules() if isinstance(m, LatentMoE))
    assert tiny_moe._rows_plan() is None
    moe = _moe()
    x = torch.randn(1, 512)
    moe.expert_range = (0, 4)                            # expert parallelism: this rank's experts only
    assert moe._rows_plan() is None
    moe.expert_range = None
    assert moe._rows_plan() is not None
    with torch.inference_mode():
        torch.set_num_threads(2)                         # a threaded forward keeps oneDNN's products
        try:
            assert moe._rows_in_c(x) is None
        finally:
            torch.set_num_threads(1)
        moe(torch.randn(17, 512))                        # more rows than the rowdot kernels take
        assert not calls
        moe(x)
    assert len(calls) == 1


@needs_ops
@pytest.mark.parametrize("contexts", [(5,), (3, 9, 1), (4, 7, 2, 6, 8, 3, 5, 10)])
def test_mla_rows_in_c_equal_the_python_path_bitwise(monkeypatch, one_thread, contexts):
    cfg = _wide_text()
    layer_id = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    layer = GatedMLA(cfg, layer_id, MLAOptions())
    _randomize(layer, 3)
    layer.fuse_linears()
    layer.eval()
    in_c = HybridCacheTensors.allocate(cfg, num_blocks=4 * len(contexts), num_slots=9, block_size=4,
                                       dtype=torch.float32)
    pages = in_c.mla_pages[layer_id]
    pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(7)))
    python = _clone(in_c)
    calls = _count_calls(monkeypatch, "mla_rows")
    gen = torch.Generator().manual_seed(9)
    tables = [torch.arange(4 * i, 4 * i + 4).flip(0) for i in range(len(contexts))]       # scattered pages
    with torch.inference_mode():
        for step in range(3):                    # each step writes its latent, the next one attends to it
            slices = [SequenceSlice(1, n + step, i, tables[i]) for i, n in enumerate(contexts)]
            x = torch.randn(len(contexts), 512, generator=gen)
            want, got = _off_then_on(lambda on, x=x, s=slices: layer(x, ForwardBatch(s, in_c if on else python)))
            assert torch.equal(got, want), (step, (got - want).abs().max())
            assert torch.equal(in_c.mla_pages[layer_id], python.mla_pages[layer_id])
    assert len(calls) == 3


@needs_ops
def test_mla_gate_in_c_equals_the_torch_form():
    ops = decode_ops.decode_ops()
    gen = torch.Generator().manual_seed(4)
    x, wide = torch.randn(3, 40, generator=gen), torch.randn(3, 47, generator=gen) * 4
    got = ops.sigmoid_gate(x, wide[:, 7:])
    torch.testing.assert_close(got.double(), x.double() * torch.sigmoid(wide[:, 7:].double()), rtol=4e-7, atol=1e-7)


@needs_ops
@pytest.mark.parametrize("rows", [1, 3])
def test_attn_res_and_norm_in_one_call_equal_the_two_calls(rows):
    gen = torch.Generator().manual_seed(6)
    sources = [torch.randn(rows, 96, generator=gen) * (i + 1) for i in range(3)]
    query, weight = torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    two, one = _off_then_on(lambda on: attnres.attn_res_norm(sources, torch.zeros(1, 96), torch.zeros(96), 1e-5,
                                                             query, weight, 1e-6))
    assert torch.equal(one, two)
    with torch.inference_mode():
        assert torch.equal(one, rms_norm(attnres.attn_res(sources, torch.zeros(1, 96), torch.zeros(96), 1e-5, query),
                                         weight, 1e-6))


def _wide_model() -> KimiK3ForConditionalGeneration:
    """The tiny preset with KDA, MLA and MoE layers wide enough for the rowdot kernels."""
    cfg = preset_config("tiny")
    model = KimiK3ForConditionalGeneration(replace(cfg, text_config=_wide_text(), vision_config=None), ModelOptions())
    init_weights(model, 0)
    model.eval().fuse_linears()
    return model


@needs_ops
def test_a_model_decoding_with_whole_layer_calls_equals_without_bitwise(monkeypatch, one_thread):
    model = _wide_model()
    counts = {name: _count_calls(monkeypatch, name) for name in ("moe_rows", "kda_rows", "mla_rows")}
    ids = torch.randint(0, 1000, (14,), generator=torch.Generator().manual_seed(8))

    def decode(on: bool) -> torch.Tensor:
        assert on or not any(counts.values())           # the Python path runs first, calling no whole layer
        runner, outs = SequenceRunner(model, 64), []
        outs.append(runner.feed(ids[:6]))
        outs += [runner.feed(ids[i:i + 1]) for i in range(6, 14)]
        return torch.cat(outs)

    without, with_calls = _off_then_on(decode)
    assert torch.equal(with_calls, without)
    cfg = model.config.text_config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    kda_layers = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    mla_layers = cfg.num_hidden_layers - kda_layers
    # the 6-token prefill runs its MoE layers in C too (at most 16 rows); KDA's and MLA's calls decode only
    assert len(counts["moe_rows"]) == 9 * moe_layers and len(counts["kda_rows"]) == 8 * kda_layers
    assert len(counts["mla_rows"]) == 8 * mla_layers > 0
