"""engine/model/decode_ops.py: the KDA recurrence and AttnRes mixing in C agree with their torch forms.

- `kda_decode` == the engine's torch forms (conv, l2 norms, gate, delta rule) for plain decoding and for
  verification, with the per-position states, on scattered slots; both gate forms;
- one T-token verification == T one-token calls, bitwise (plain decoding and verification run the same
  per-token code, so a speculative step keeps plain decoding's values);
- a KDA layer's forward over a mixed batch (decode, verification, prefill) == its torch path, outputs
  and cache, to rounding;
- absorbed MLA attention in C (decode and verification rows, each over its own causal context) == torch;
- `attn_res` in C == its torch form; SiTU in C within two ulp of the float64 formula;
- the MoE router's choice in C == torch's (same experts, weights to rounding);
- `KIMI_PD_CPU_DECODE_OPS=0` keeps the torch form, `KIMI_PD_CPU_DECODE_LAYERS=0` the per-operator calls
  (a child process).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from engine.model import attnres, decode_ops, layers
from engine.model import moe as moe_module
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kda_ops import causal_conv_steps, kda_gate, kda_recurrent_states
from engine.model.layers import l2norm
from tests.engine.conftest import kda_layer_and_cache, tiny_model

needs_ops = pytest.mark.skipif(decode_ops.decode_ops() is None, reason="no C compiler / not x86-64 Linux / no AVX2")
close = dict(rtol=1e-4, atol=2e-5)


def _inputs(batch: int, tokens: int, heads: int = 3, k_dim: int = 16, width: int = 4, slots: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    channels = 3 * heads * k_dim
    return dict(
        qkv=torch.randn(batch, tokens, channels, generator=gen),
        raw=torch.randn(batch, tokens, heads * k_dim, generator=gen),
        b_raw=torch.randn(batch, tokens, heads, generator=gen),
        kernel=torch.randn(channels, width, generator=gen),
        a_log=torch.randn(heads, generator=gen) * 0.3,
        dt_bias=torch.randn(heads * k_dim, generator=gen),
        conv=torch.randn(slots, width - 1, channels, generator=gen),
        rec=torch.randn(slots, heads, k_dim, k_dim, generator=gen) * 0.2,
    )


def torch_reference(qkv, raw_gate, b_raw, kernel, a_log, dt_bias, lower_bound, conv, rec, scale):
    """What `kda_decode` computes, in the engine's torch forms (engine/model/kda_ops.py) on [B, T, ...]
    inputs and states [B, ...]: (o [B, T, H, V], conv states [B, T, W-1, C], recurrent states [T, B, H, K, V])."""
    batch, tokens = qkv.shape[:2]
    heads, k_dim = rec.shape[1:3]
    mixed, conv_states = causal_conv_steps(qkv, kernel, conv)
    q, k, v = mixed.view(batch, tokens, 3, heads, k_dim).unbind(2)
    g = kda_gate(raw_gate.view(batch, tokens, heads, k_dim), a_log, dt_bias, lower_bound)
    o, rec_states = kda_recurrent_states(l2norm(q), l2norm(k), v, g, torch.sigmoid(b_raw), rec, scale)
    return o, conv_states, rec_states


def _run_c(d: dict, slots: torch.Tensor, spec: torch.Tensor | None, lower: float | None, scale: float) -> torch.Tensor:
    ops = decode_ops.decode_ops()
    assert ops is not None
    batch, tokens, channels = d["qkv"].shape
    heads = d["b_raw"].shape[-1]
    raw = d["raw"]
    if lower is None:            # the softplus gate: the caller passes the log-decay itself
        raw = kda_gate(raw.view(batch, tokens, heads, -1), d["a_log"], d["dt_bias"], None).reshape(raw.shape)
    o = ops.kda_decode(d["qkv"].reshape(-1, channels), raw.reshape(batch * tokens, -1).contiguous(),
                       d["b_raw"].reshape(-1, heads).contiguous(), d["kernel"].t().contiguous(),
                       d["a_log"].exp() if lower is not None else None, d["dt_bias"], lower,
                       d["conv"], d["rec"], slots, spec, scale)
    return o.view(batch, tokens, heads, -1)


@needs_ops
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("lower", [-5.0, None])
def test_kda_decode_equals_the_torch_recurrence(tokens, lower):
    d = _inputs(batch=3, tokens=tokens)
    slots = torch.tensor([7, 0, 4])
    spec = torch.tensor([[1, 2, 3], [5, 6, 8], [9, 10, 11]])[:, :tokens - 1] if tokens > 1 else None
    want_o, want_conv, want_rec = torch_reference(
        d["qkv"], d["raw"], d["b_raw"], d["kernel"], d["a_log"], d["dt_bias"], lower,
        d["conv"][slots], d["rec"][slots], 0.25)
    written = set(slots.tolist()) | (set() if spec is None else set(spec.reshape(-1).tolist()))
    untouched = [s for s in range(12) if s not in written]
    before = d["conv"][untouched].clone(), d["rec"][untouched].clone()
    got = _run_c(d, slots, spec, lower, 0.25)
    torch.testing.assert_close(got, want_o, **close)
    torch.testing.assert_close(d["conv"][slots], want_conv[:, -1], **close)
    torch.testing.assert_close(d["rec"][slots], want_rec[-1], **close)
    if spec is not None:
        for t in range(tokens - 1):
            torch.testing.assert_close(d["conv"][spec[:, t]], want_conv[:, t], **close)
            torch.testing.assert_close(d["rec"][spec[:, t]], want_rec[t], **close)
    assert torch.equal(d["conv"][untouched], before[0]) and torch.equal(d["rec"][untouched], before[1])


@needs_ops
def test_verification_equals_plain_decoding_token_by_token_bitwise():
    tokens = 5
    whole, stepwise = _inputs(batch=2, tokens=tokens), _inputs(batch=2, tokens=tokens)
    slots = torch.tensor([3, 8])
    spec = torch.tensor([[0, 1, 2, 4], [5, 6, 7, 9]])
    o_whole = _run_c(whole, slots, spec, -5.0, 0.125)
    for t in range(tokens):
        step = dict(stepwise, qkv=stepwise["qkv"][:, t:t + 1].contiguous(), raw=stepwise["raw"][:, t:t + 1],
                    b_raw=stepwise["b_raw"][:, t:t + 1])
        o_t = _run_c(step, slots, None, -5.0, 0.125)
        assert torch.equal(o_t[:, 0], o_whole[:, t])
        if t < tokens - 1:                    # the per-position state after token t, as plain decoding had it
            assert torch.equal(whole["rec"][spec[:, t]], stepwise["rec"][slots])
            assert torch.equal(whole["conv"][spec[:, t]], stepwise["conv"][slots])
    assert torch.equal(whole["rec"][slots], stepwise["rec"][slots])


def _layer_and_cache(model):
    return kda_layer_and_cache(model, num_slots=12, scale=0.3)


def _clone(cache: HybridCacheTensors) -> HybridCacheTensors:
    return HybridCacheTensors(block_size=cache.block_size, mla_pages=cache.mla_pages,
                              kda_conv={i: t.clone() for i, t in cache.kda_conv.items()},
                              kda_recurrent={i: t.clone() for i, t in cache.kda_recurrent.items()})


@needs_ops
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_a_kda_layer_in_c_equals_its_torch_path(monkeypatch, mix):
    model = tiny_model()
    layer, cache = _layer_and_cache(model)
    other = _clone(cache)
    table = torch.tensor([0, 1])
    if mix == "decode":
        slices = [SequenceSlice(1, 5, s, table) for s in (6, 2, 9)]
    else:          # a decode, a 3-token verification, a fresh 4-token prefill, another decode
        slices = [SequenceSlice(1, 5, 2, table), SequenceSlice(3, 5, 3, table, spec_slots=(7, 8)),
                  SequenceSlice(4, 0, 4, table, reset_kda_state=True), SequenceSlice(1, 7, 9, table)]
    rows = sum(s.num_new_tokens for s in slices)
    x = torch.randn(rows, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = layer(x, ForwardBatch(slices, cache))
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
        want = layer(x, ForwardBatch(slices, other))
    torch.testing.assert_close(got, want, **close)
    lid = layer.layer_id
    torch.testing.assert_close(cache.kda_conv[lid], other.kda_conv[lid], **close)
    torch.testing.assert_close(cache.kda_recurrent[lid], other.kda_recurrent[lid], **close)


@needs_ops
@pytest.mark.parametrize("sources", [1, 2, 5])
@pytest.mark.parametrize("rows", [1, 7])
def test_attn_res_in_c_equals_the_torch_form(monkeypatch, sources, rows):
    gen = torch.Generator().manual_seed(sources * 10 + rows)
    parts = [torch.randn(rows, 96, generator=gen) * (1 + i) for i in range(sources)]
    proj, norm = torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    query = attnres.pseudo_query(proj, norm)
    with torch.inference_mode():
        got = attnres.attn_res(parts, proj, norm, 1e-5, query)
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
        want = attnres.attn_res(parts, proj, norm, 1e-5, query)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("renormalize, scaling", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("top_k", [1, 4])
def test_moe_route_in_c_chooses_as_torch_does(monkeypatch, renormalize, scaling, top_k):
    gen = torch.Generator().manual_seed(top_k)
    wide = torch.randn(9, 40, generator=gen) * 3
    logits = wide[:, 3:35]                      # a strided view, as the fused projection's output gives it
    bias = torch.randn(32, generator=gen) * 0.5
    with torch.inference_mode():
        weights, ids = moe_module.route(logits, bias, top_k, renormalize, scaling)
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
        want_weights, want_ids = moe_module.route(logits, bias, top_k, renormalize, scaling)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@needs_ops
def test_mla_attention_in_c_equals_its_torch_path(monkeypatch):
    """Two one-token decodes, a three-token verification (absorbed, causal) and a 10-token prefill
    (materialised, on torch either way) in one batch over scattered pages: outputs and pages agree."""
    model = tiny_model()
    cfg = model.config.text_config
    layer = model.language_model.model.layers[cfg.mla_layer_ids[0]].self_attn
    cache = HybridCacheTensors.allocate(cfg, num_blocks=16, num_slots=4, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    for pages in cache.mla_pages.values():
        pages.copy_(torch.randn(pages.shape, generator=gen))
    other = HybridCacheTensors(block_size=4, mla_pages={i: p.clone() for i, p in cache.mla_pages.items()},
                               kda_conv=cache.kda_conv, kda_recurrent=cache.kda_recurrent)
    slices = [SequenceSlice(1, 6, 0, torch.tensor([3, 9])), SequenceSlice(3, 5, 1, torch.tensor([12, 1])),
              SequenceSlice(10, 0, 2, torch.tensor([4, 14, 7])), SequenceSlice(1, 2, 3, torch.tensor([8]))]
    x = torch.randn(15, cfg.hidden_size, generator=gen)
    calls = []
    real = decode_ops.DecodeOps.mla_attend
    monkeypatch.setattr(decode_ops.DecodeOps, "mla_attend",
                        lambda self, q, *a: calls.append(len(q)) or real(self, q, *a))
    with torch.inference_mode():
        got = layer(x, ForwardBatch(slices, cache))
        assert calls == [5]                           # the decodes' and the verification's rows, in one call
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
        want = layer(x, ForwardBatch(slices, other))
    torch.testing.assert_close(got, want, **close)
    for i in cache.mla_pages:
        torch.testing.assert_close(cache.mla_pages[i], other.mla_pages[i], **close)


@needs_ops
@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_situ_in_c_is_within_two_ulp_of_float64(scale, linear_beta):
    """Against the float64 formula, as close as torch's float32 operators are (their error, doubled)."""
    gen = torch.Generator().manual_seed(int(scale * 1000))
    wide = torch.randn(5, 2 * 96, generator=gen) * scale
    gate, up = wide[:, :96], wide[:, 96:]                   # strided rows: a fused gate|up output's halves
    exact = layers.situ(gate.double(), up.double(), 4.0, linear_beta)
    with torch.inference_mode():
        got = layers.situ(gate, up, 4.0, linear_beta)
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(decode_ops, "usable", lambda *tensors: None)
        torch_form = layers.situ(gate, up, 4.0, linear_beta)
        monkeypatch.undo()
    error = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    torch_error = ((torch_form.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    assert not torch.equal(got, torch_form) or scale == 1e-3      # the C form ran (it rounds differently)
    assert error <= max(2 * torch_error, 2.4e-7)


CHILD = """
import engine, torch
from engine.model import decode_ops
with torch.inference_mode():
    print("ops", decode_ops.decode_ops() is not None, "layers", decode_ops.layer_usable(torch.zeros(1)) is not None)
"""


@needs_ops
@pytest.mark.parametrize("variable, value, expect", [
    (decode_ops.ENABLE_ENV, "0", "ops False layers False"), (decode_ops.ENABLE_ENV, "1", "ops True layers True"),
    (decode_ops.LAYERS_ENV, "0", "ops True layers False"), (decode_ops.LAYERS_ENV, "1", "ops True layers True")])
def test_the_operator_can_turn_them_off(variable, value, expect):
    """`KIMI_PD_CPU_DECODE_OPS=0`: no C op at all; `KIMI_PD_CPU_DECODE_LAYERS=0`: the per-operator calls only."""
    env = {**os.environ, variable: value}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout


def _c_letters(source: str, symbol: str) -> tuple[str, str]:
    """(return type, argument types) of `symbol`'s definition in decode_ops.c, one letter each as
    decode_ops._C_TYPES names them ("" returns nothing)."""
    found = re.search(r"^(?:HOT )?(void|long) " + symbol + r"\(([^)]*)\)", source, re.M)
    assert found, symbol
    letters = ""
    for parameter in found.group(2).split(","):
        words = parameter.split()
        letters += "p" if "*" in parameter else {"long": "l", "int": "i", "float": "f"}[words[-2]]
    return ("" if found.group(1) == "void" else "l"), letters


def test_every_binding_matches_its_c_definition():
    """A ctypes binding with a wrong argument list passes garbage silently: each one is held to the C source."""
    source = decode_ops.SOURCE.read_text()
    for symbol, returns, arguments in decode_ops._ENTRIES.values():
        assert _c_letters(source, symbol) == (returns, arguments), symbol
