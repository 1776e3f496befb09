"""KDA's chunked (WY / UT) form for training: many sequences at once, matmuls instead of a 5-D decay.

The serving form (`engine.model.kda_ops.kda_chunked`) forms every pairwise decay `exp(G_i - G_j)`
per key dimension as a `[H, n, C, C, K]` tensor, which is exact for any chunk size but makes the
intra-chunk step (forward and backward) the largest cost of a training step on CPU. Here the pairwise
decay is factorised around the chunk's middle position m,
`exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j)`, so the intra-chunk products become two batched
matmuls. With the K3 gate's lower bound (log-decay >= -5 per token) a chunk of C tokens keeps every
factor within exp(+-5 C / 2), far inside fp32 for C <= 16, so both forms agree to fp32 rounding
(`tests/engine/training/test_training.py` checks this form against the serving forward). Only the
state pass is sequential, and it carries the state alone: outputs are one batched product afterwards.
"""
from __future__ import annotations

import torch

MAX_CHUNK = 16        # exp(5 * 16 / 2) = exp(40): factors stay far inside fp32 (forward and backward)


def kda_chunked_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, chunk: int) -> torch.Tensor:
    """q, k, g: [N, T, K] (N = sequences x heads, q/k l2-normalised); v: [N, T, V]; beta: [N, T].

    Returns o [N, T, V] fp32, from a zero initial state (a training sequence starts empty). The tail
    is padded with k = v = g = beta = 0, which leaves the state untouched.
    """
    if chunk > MAX_CHUNK:
        raise ValueError(f"kda_chunked_dense supports chunks up to {MAX_CHUNK} tokens, got {chunk}")
    n_seq, t_len, dk = q.shape
    dv = v.shape[-1]
    c = chunk
    total = -(-t_len // c) * c
    pad = total - t_len
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    n = total // c
    q, k, g = (x.reshape(n_seq, n, c, dk) for x in (q * scale, k, g))
    v = v.reshape(n_seq, n, c, dv)
    beta = beta.reshape(n_seq, n, c, 1)
    big_g = g.cumsum(dim=2)                                           # [N, n, C, K]
    mid = big_g[:, :, c // 2: c // 2 + 1]
    k_in = k * (big_g - mid).exp()                                     # k_i exp(G_i - G_m)
    k_out = k * (mid - big_g).exp()                                    # k_j exp(G_m - G_j)
    q_in = q * (big_g - mid).exp()
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    l_mat = (k_in @ k_out.transpose(-1, -2)) * beta * strict          # [N, n, C, C]
    a_mat = (q_in @ k_out.transpose(-1, -2)) * incl
    lower = torch.eye(c, dtype=q.dtype, device=q.device) + l_mat
    w_mat = torch.linalg.solve_triangular(lower, beta * big_g.exp() * k, upper=False, unitriangular=True)
    u_mat = torch.linalg.solve_triangular(lower, beta * v, upper=False, unitriangular=True)
    g_last = big_g[:, :, -1:]                                          # [N, n, 1, K]
    k_dec_t = ((g_last - big_g).exp() * k).transpose(-1, -2)           # [N, n, K, C]
    state_decay = g_last.transpose(-1, -2).exp()                       # [N, n, K, 1]
    s = q.new_zeros(n_seq, dk, dv)
    states, v_news = [], []
    chunks = zip(w_mat.unbind(1), u_mat.unbind(1), k_dec_t.unbind(1), state_decay.unbind(1), strict=False)
    for w_i, u_i, kd_i, sd_i in chunks:
        states.append(s)
        v_new = u_i - w_i @ s                                          # [N, C, V]
        v_news.append(v_new)
        s = sd_i * s + kd_i @ v_new
    s_before = torch.stack(states, dim=1)                              # [N, n, K, V]
    v_new = torch.stack(v_news, dim=1)                                 # [N, n, C, V]
    o = (q * big_g.exp()) @ s_before + a_mat @ v_new
    return o.reshape(n_seq, total, dv)[:, :t_len]
