"""Kimi Delta Attention maths as pure tensor functions (docs/model.md, KDA).

State layout (engine/model/choices.py): recurrent state `S[h]` is key-major `[K, V]`, fp32. The
recurrence per token, per head, is `S <- diag(exp(g)) S; S <- S + beta k (v - S^T k)^T; o = S^T q`.
Two forms compute it: `kda_recurrent` (one token at a time, batched over sequences; decode) and
`kda_chunked` (the WY/UT chunked form over one sequence; prefill). They agree to fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers import cast, upcast


def kda_gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Log-decay `g [..., H, K]` (<= 0) from raw gate logits `raw [..., H, K]`.

    `a_log [H]` is per head (choices.A_LOG_PER_HEAD). With a lower bound (K3: -5) the gate is the
    bounded sigmoid form `lb * sigmoid(exp(A_log) * (raw + dt_bias))`, else `-exp(A_log) * softplus(.)`.
    """
    h, k = raw.shape[-2:]
    z = upcast(raw) + upcast(dt_bias).view(h, k)
    a = upcast(a_log).exp().view(h, 1)
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


def causal_conv_with_state(x: torch.Tensor, weight: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over time for one sequence.

    x: [T, C] pre-conv inputs; weight: [C, W]; state: [W-1, C], the inputs before x (zeros at the
    start of a sequence). Returns (y [T, C], new_state [W-1, C]); computed in fp32.
    """
    w = weight.shape[-1]
    xx = upcast(torch.cat([cast(state, x.dtype), x], dim=0))          # [W-1+T, C]
    windows = xx.unfold(0, w, 1)                                    # [T, C, W]
    y = F.silu((windows * upcast(weight)).sum(-1))
    return cast(y, x.dtype), cast(xx[-(w - 1):], state.dtype)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for B sequences: x [B, C], state [B, W-1, C] -> (y [B, C], new_state)."""
    xx = upcast(torch.cat([cast(state, x.dtype), x[:, None]], dim=1))  # [B, W, C]
    y = F.silu((xx * upcast(weight).t()[None]).sum(1))
    return cast(y, x.dtype), cast(xx[:, 1:], state.dtype)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token recurrence, batched over B sequences.

    q, k: [B, T, H, K] (l2-normalised); v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H];
    state: [B, H, K, V] fp32. Returns (o [B, T, H, V] fp32, final state fp32). Inputs are not mutated.
    Token t's arithmetic is the same whether it runs alone (T=1) or inside a longer T
    (`kda_recurrent_states` is this loop keeping every state, for speculative verification).
    """
    s = upcast(state)
    q, k, v, g, beta = upcast(q) * scale, upcast(k), upcast(v), upcast(g), upcast(beta)
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None]
        kv_mem = (k[:, t, :, None, :] @ s).squeeze(-2)                   # S^T k: [B, H, V]
        delta = beta[:, t, :, None] * (v[:, t] - kv_mem)
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((q[:, t, :, None, :] @ s).squeeze(-2))
    return torch.stack(outs, dim=1), s


def causal_conv_steps(x: torch.Tensor, weight: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T decode tokens for B sequences at once, each as `causal_conv_step` computes it: x [B, T, C],
    state [B, W-1, C] -> (y [B, T, C], the state after every token [B, T, W-1, C]).

    Token t's window is the same [W, C] product summed over W as in the one-token step (the windows
    are views of one concatenated input), so speculative verification keeps plain decoding's conv
    arithmetic while running its T tokens in a handful of operations instead of ~8 per token."""
    w = weight.shape[-1]
    xx = upcast(torch.cat([cast(state, x.dtype), x], dim=1))          # [B, W-1+T, C]
    windows = xx.unfold(1, w, 1).transpose(-1, -2)                    # [B, T, W, C] (a view)
    y = F.silu((windows * upcast(weight).t()).sum(-2))
    states = xx[:, 1:].unfold(1, w - 1, 1).transpose(-1, -2)          # [B, T, W-1, C] (a view)
    return cast(y, x.dtype), cast(states, state.dtype)


def kda_recurrent_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_recurrent` that also returns the state after every token, for speculative verification.

    Same shapes in; returns (o [B, T, H, V] fp32, states [T, B, H, K, V] fp32; states[-1] is the final
    state). Each token's update is the recurrence's own arithmetic, bit for bit, written into one
    preallocated buffer (no per-token state tensors to stack afterwards), with the inputs laid out
    token-major once so no per-token product has to copy a strided operand first (test_kda)."""
    q, k, v, g, beta = (upcast(x).transpose(0, 1).contiguous() for x in (q, k, v, g, beta))   # [T, B, ...]
    q = q * scale
    decay = g.exp()[..., None]                                          # [T, B, H, K, 1]
    prev = upcast(state)
    states = prev.new_empty((k.shape[0], *prev.shape))
    outs = []
    for t in range(k.shape[0]):
        s = torch.mul(prev, decay[t], out=states[t])
        kv_mem = (k[t, :, :, None, :] @ s).squeeze(-2)                   # S^T k: [B, H, V]
        delta = beta[t, :, :, None] * (v[t] - kv_mem)
        s.add_(k[t, :, :, :, None] * delta[:, :, None, :])
        outs.append((q[t, :, :, None, :] @ s).squeeze(-2))
        prev = s
    return torch.stack(outs, dim=1), states


def kda_recurrent_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, scale: float) -> torch.Tensor:
    """One token for B sequences, updating the fp32 `state` [B, H, K, V] in place (a view of the cache).

    q, k: [B, H, K]; v: [B, H, V]; g: [B, H, K]; beta: [B, H]. Returns o [B, H, V] fp32. The arithmetic
    of one `kda_recurrent` step, operation for operation, so the two agree bitwise; in place, the
    state is neither gathered out of the cache nor scattered back (two state copies per layer and step).
    """
    q, k, v, g, beta = upcast(q) * scale, upcast(k), upcast(v), upcast(g), upcast(beta)
    state.mul_(g.exp()[..., None])
    kv_mem = (k[:, :, None, :] @ state).squeeze(-2)                      # S^T k: [B, H, V]
    delta = beta[:, :, None] * (v - kv_mem)
    state.add_(k[:, :, :, None] * delta[:, :, None, :])
    return (q[:, :, None, :] @ state).squeeze(-2)


def _pad_time(x: torch.Tensor, total: int) -> torch.Tensor:
    pad = total - x.shape[0]
    return x if pad == 0 else torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, scale: float, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) form over one sequence; any length T.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K]; beta: [T, H]; state: [H, K, V] fp32.
    Returns (o [T, H, V] fp32, final state [H, K, V] fp32). The tail is padded with k = v = g =
    beta = 0, which leaves the state untouched (no decay, no update), so padding is exact.

    Within a chunk, with G the cumulative log-decay (reset per chunk):
      L[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i);  W = (I+L)^-1 (beta exp(G) k);  U = (I+L)^-1 (beta v)
      V' = U - W S;  O = (q exp(G)) S + A V' with A[i,j] = sum_d q_i k_j exp(G_i - G_j) (j <= i)
      S <- exp(G_last) S + (exp(G_last - G) k)^T V'
    Pairwise decays are formed as exp(G_i - G_j) with j <= i (never exp(+large)), so no overflow.
    """
    t_len, h, dk = q.shape
    c = chunk_size
    total = -(-t_len // c) * c
    q, k, v, g = (_pad_time(upcast(x), total) for x in (q, k, v, g))
    beta = _pad_time(upcast(beta), total)
    n = total // c
    # [H, N, C, .]
    q = q * scale
    q, k, v, g = (x.view(n, c, h, -1).permute(2, 0, 1, 3) for x in (q, k, v, g))
    beta = beta.view(n, c, h).permute(2, 0, 1)
    s = upcast(state).clone()
    per_chunk_bytes = h * c * c * dk * 4 * 3
    group = max(1, _INTRA_CHUNK_BYTES // per_chunk_bytes)
    outs = []
    for lo in range(0, n, group):
        sl = slice(lo, min(n, lo + group))
        o, s = _chunk_group(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s)
        outs.append(o)
    o = torch.cat(outs, dim=1).reshape(h, total, -1).permute(1, 0, 2)[:t_len]
    return o, s


# Bound on the temporary [H, n, C, C, K] pairwise-decay tensors of one group of chunks.
_INTRA_CHUNK_BYTES = 64 * 2**20


def _chunk_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Intra-chunk WY quantities for a group of chunks `[H, n, C, .]`, then the sequential state pass."""
    c = q.shape[2]
    big_g = g.cumsum(dim=2)
    diff = big_g[:, :, :, None, :] - big_g[:, :, None, :, :]                      # G_i - G_j
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl[..., None], diff, diff.new_full((), float("-inf"))).exp()
    del diff
    strict = incl & ~torch.eye(c, dtype=torch.bool, device=q.device)
    l_mat = torch.einsum("hnid,hnjd,hnijd->hnij", k, k, decay) * beta[..., None] * strict
    a_mat = torch.einsum("hnid,hnjd,hnijd->hnij", q, k, decay)                    # diag included
    del decay
    lower = torch.eye(c, dtype=q.dtype, device=q.device) + l_mat
    w_mat = torch.linalg.solve_triangular(lower, beta[..., None] * big_g.exp() * k, upper=False, unitriangular=True)
    u_mat = torch.linalg.solve_triangular(lower, beta[..., None] * v, upper=False, unitriangular=True)
    outs = []
    for i in range(q.shape[1]):
        v_new = u_mat[:, i] - w_mat[:, i] @ s                                       # [H, C, V]
        outs.append((q[:, i] * big_g[:, i].exp()) @ s + a_mat[:, i] @ v_new)
        g_last = big_g[:, i, -1]                                                    # [H, K]
        k_dec = (g_last[:, None, :] - big_g[:, i]).exp() * k[:, i]                  # [H, C, K]
        s = g_last.exp()[..., None] * s + k_dec.transpose(1, 2) @ v_new
    return torch.stack(outs, dim=1), s
