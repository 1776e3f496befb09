"""KDA: chunked == recurrent == float64 loop == fla-core's naive oracles; conv state carries exactly."""
from __future__ import annotations

import pytest
import torch

from engine.model.kda_ops import (
    causal_conv_step,
    causal_conv_steps,
    causal_conv_with_state,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    kda_recurrent_states,
)
from engine.model.layers import l2norm
from tests.engine.oracles import fla_attnres_naive, fla_gate_functions, fla_kda_naive, kda_float64_loop

H, K = 2, 16
SCALE = K ** -0.5


def random_inputs(t: int, seed: int, with_state: bool):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, H, K, generator=gen))
    k = l2norm(torch.randn(t, H, K, generator=gen))
    v = torch.randn(t, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(t, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(t, H, generator=gen))
    state = torch.randn(H, K, K, generator=gen) if with_state else torch.zeros(H, K, K)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 7, 8, 16, 21])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_equals_float64_loop(t, with_state):
    q, k, v, g, beta, s0 = random_inputs(t, seed=t, with_state=with_state)
    ref_o, ref_s = kda_float64_loop(q, k, v, g, beta, s0, SCALE)
    rec_o, rec_s = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], s0[None], SCALE)
    chk_o, chk_s = kda_chunked(q, k, v, g, beta, s0, SCALE, chunk_size=8)
    torch.testing.assert_close(rec_o[0].double(), ref_o, rtol=0, atol=2e-6)
    torch.testing.assert_close(rec_s[0].double(), ref_s, rtol=0, atol=2e-6)
    torch.testing.assert_close(chk_o.double(), ref_o, rtol=0, atol=2e-6)
    torch.testing.assert_close(chk_s.double(), ref_s, rtol=0, atol=2e-6)


def test_chunked_in_float64_is_exact():
    q, k, v, g, beta, s0 = (x.double() for x in random_inputs(19, seed=3, with_state=True))
    ref_o, ref_s = kda_float64_loop(q, k, v, g, beta, s0, SCALE)
    o, s = kda_chunked(q, k, v, g, beta, s0, SCALE, chunk_size=8)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=1e-12)


def test_splitting_a_sequence_carries_state_exactly():
    q, k, v, g, beta, s0 = random_inputs(20, seed=5, with_state=True)
    whole_o, whole_s = kda_chunked(q, k, v, g, beta, s0, SCALE, chunk_size=8)
    o1, s1 = kda_chunked(q[:13], k[:13], v[:13], g[:13], beta[:13], s0, SCALE, chunk_size=8)
    o2, s2 = kda_chunked(q[13:], k[13:], v[13:], g[13:], beta[13:], s1, SCALE, chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2]), whole_o, rtol=0, atol=2e-6)
    torch.testing.assert_close(s2, whole_s, rtol=0, atol=2e-6)


@pytest.mark.parametrize("with_state", [False, True])
def test_matches_fla_naive_recurrent_and_chunk(with_state):
    naive = fla_kda_naive()
    q, k, v, g, beta, s0 = random_inputs(16, seed=11, with_state=with_state)
    ours, ours_s = kda_chunked(q, k, v, g, beta, s0, SCALE, chunk_size=8)
    rec, rec_s = naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=SCALE,
                                           initial_state=s0[None], output_final_state=True)
    chk, chk_s = naive.naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=SCALE,
                                       initial_state=s0[None], output_final_state=True, chunk_size=8)
    for o, s in ((rec, rec_s), (chk, chk_s)):
        torch.testing.assert_close(ours, o[0].float(), rtol=0, atol=2e-6)
        torch.testing.assert_close(ours_s, s[0].float(), rtol=0, atol=2e-6)


def test_gate_matches_fla_lowerbound_and_softplus_gates():
    fns = fla_gate_functions()
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(5, H, K, generator=gen)
    a_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    torch.testing.assert_close(kda_gate(raw, a_log, dt_bias, -5.0),
                               fns["naive_kda_lowerbound_gate"](raw, a_log, dt_bias, lower_bound=-5.0))
    torch.testing.assert_close(kda_gate(raw, a_log, dt_bias, None), fns["naive_kda_gate"](raw, a_log, dt_bias))
    g = kda_gate(raw, a_log, dt_bias, -5.0)
    assert bool(((g > -5.0) & (g < 0.0)).all())


def test_conv_state_carries_and_step_matches():
    gen = torch.Generator().manual_seed(2)
    c, w = 12, 4
    x, weight = torch.randn(10, c, generator=gen), torch.randn(c, w, generator=gen)
    zero = torch.zeros(w - 1, c)
    whole, whole_state = causal_conv_with_state(x, weight, zero)
    # reference: an explicit zero-padded causal conv
    padded = torch.cat([zero, x])
    ref = torch.nn.functional.silu(torch.stack([(padded[t:t + w] * weight.t()).sum(0) for t in range(10)]))
    torch.testing.assert_close(whole, ref)
    first, state = causal_conv_with_state(x[:6], weight, zero)
    rest = []
    for t in range(6, 10):
        y, state = causal_conv_step(x[t:t + 1], weight, state[None])
        state = state[0]
        rest.append(y)
    torch.testing.assert_close(torch.cat([first, *rest]), whole)
    torch.testing.assert_close(state, whole_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
def test_verification_forms_equal_token_by_token_decoding_bitwise(dtype, batch):
    """Speculative verification runs T tokens at once (causal_conv_steps, kda_recurrent_states); every
    output and every per-position state must be bit for bit what T one-token decode steps compute,
    so a rolled-back request continues exactly as if it had decoded plainly."""
    gen = torch.Generator().manual_seed(11 + batch)
    t_len, c, w = 5, 3 * H * K, 4
    x, weight = torch.randn(batch, t_len, c, generator=gen, dtype=dtype), torch.randn(c, w, generator=gen, dtype=dtype)
    conv0 = torch.randn(batch, w - 1, c, generator=gen, dtype=dtype)
    ys, conv_states, conv = [], [], conv0
    for t in range(t_len):
        y, conv = causal_conv_step(x[:, t], weight, conv)
        ys.append(y)
        conv_states.append(conv)
    y_all, conv_all = causal_conv_steps(x, weight, conv0)
    assert torch.equal(y_all, torch.stack(ys, dim=1)) and torch.equal(conv_all, torch.stack(conv_states, dim=1))

    def rand(*shape):
        return torch.randn(batch, t_len, *shape, generator=gen, dtype=dtype)
    q, k = l2norm(rand(H, K)), l2norm(rand(H, K))
    v, g, beta = rand(H, K), -5.0 * torch.sigmoid(rand(H, K)), torch.sigmoid(rand(H))
    s0 = torch.randn(batch, H, K, K, generator=gen, dtype=dtype)
    o_steps, states, s = [], [], s0
    for t in range(t_len):                       # one token at a time, as plain decoding runs them
        o, s = kda_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s, SCALE)
        o_steps.append(o[:, 0])
        states.append(s)
    o_all, states_all = kda_recurrent_states(q, k, v, g, beta, s0, SCALE)
    assert torch.equal(o_all, torch.stack(o_steps, dim=1))
    assert torch.equal(states_all, torch.stack(states))


def test_attnres_matches_fla_naive():
    from engine.model.attnres import attn_res
    naive = fla_attnres_naive()
    gen = torch.Generator().manual_seed(4)
    sources = [torch.randn(7, 32, generator=gen) for _ in range(4)]
    proj, norm = torch.randn(1, 32, generator=gen), 1 + 0.1 * torch.randn(32, generator=gen)
    expected = naive.naive_attnres(query=proj.flatten(), residuals=sources, rms_weight=norm, rms_eps=1e-5)
    torch.testing.assert_close(attn_res(sources, proj, norm, 1e-5), expected, rtol=1e-6, atol=1e-6)
