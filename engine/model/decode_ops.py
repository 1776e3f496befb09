"""A decode step's small operators in one C call each (`decode_ops.c`), for float32 rows on the CPU.

Why: with the linears streaming near one thread's read rate, about half of a small-preset decode step
was some 1,300 torch operator calls of a few microseconds each over a few kilobytes: a KDA layer's
recurrence alone was about forty (short conv, SiLU, l2 norms, gate, decay, delta rule), torch's CPU
RMSNorm six, MLA's absorbed attention a chain of small batched matmuls
(benchmarks/results/engine_throughput.md). Here each is one call:

- `kda_decode`: a KDA layer's tokens, one pass per head over the cache's state, in place. It serves
  every token the recurrent form serves, plain decoding (one token per sequence, any slots) and
  speculative verification (T tokens per sequence, the state after each kept in the sequence's
  per-position slots), so a token's arithmetic never depends on which of the two ran it. Prefill keeps
  the chunked torch form.
- `mla_attend`: absorbed MLA attention of decode and verification rows, each over its own causal
  context read straight from the pages.
- `attn_res`, `route`, `rms_norm`, `situ`: AttnRes mixing, the MoE router's choice, RMSNorm, SiTU.
- `attn_res_norm`: a layer's AttnRes mixing and the RMSNorm after it.
- `sigmoid_gate`: MLA's output gate; `mla_rows`: a gated MLA layer's decoding tokens, whole.
- `gated_rms_norm`: KDA's output norm times the sigmoid of its gate.
- `kda_rows`: a KDA layer's decoding tokens after its input projections (recurrence, gated norm, o_proj).
- `moe_rows`: a whole latent MoE layer for a decode step's few tokens, its linears on rowdot.c's kernels
  (built into this library too): the calls the Python path makes, in its order, so bitwise its result,
  without some thirty trips through Python (engine/model/moe.py's `_rows_in_c`).

Every row is computed on its own, so a row's value does not depend on its batch. Against the torch
forms they differ in rounding only (exp and tanh are polynomials of about one ulp); the load-time check
and tests/engine/model/test_decode_ops.py hold them to those forms.

Used where `rowdot.kernel()` can be (x86-64 Linux, AVX-512F or AVX2, a C compiler or a prebuilt library, not
switched off) on float32 tensors outside autograd and compiling, at any thread count.
`KIMI_PD_CPU_DECODE_OPS=0` keeps torch's operators; `set_enabled` switches them in-process (A/B runs).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from engine.host_threads import switched_off
from engine.model import rowdot

log = logging.getLogger(__name__)

ENABLE_ENV = "KIMI_PD_CPU_DECODE_OPS"
SOURCE = rowdot.SOURCE.with_name("decode_ops.c")
MAX_HEAD_DIM = 256                  # the C code keeps a head's vectors on the stack


_C_TYPES = {"l": ctypes.c_long, "p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}
# attribute -> (C symbol, return type or "", argument types), one letter each (`_C_TYPES`), as decode_ops.c
# declares them (tests/engine/model/test_decode_ops.py holds each to the source)
_ENTRIES: dict[str, tuple[str, str, str]] = {
    "_kda": ("kda_decode", "", "llllllplppppfpppppfp"),
    "_attn_res": ("attn_res_rows", "", "lpllpfp"),
    "_route": ("moe_route", "", "llplplifpp"),
    "_rms_norm": ("rms_norm_rows", "", "llplpfp"),
    "_mla": ("mla_attend", "", "llllllpppppppfpp"),
    "_situ": ("situ_rows", "", "llplplffp"),
    "moe_rows": ("moe_rows", "l", "llllllllppppifpppppfppppffpppp"),
    "_gated_norm": ("gated_rms_norm_rows", "", "lllppfplp"),
    "kda_rows": ("kda_rows", "", "lllllplppppfppppfppfppllpp"),
    "_sigmoid_gate": ("sigmoid_gate_rows", "", "llpplp"),
    "mla_rows": ("mla_rows", "", "lllllllllppppfpppfpppppppfpppp"),
    "_attn_res_norm": ("attn_res_norm_rows", "", "lpllpfpfpp"),
}


class DecodeOps:
    """The loaded library."""

    # the C entries, bound from `_ENTRIES` when the library loads
    _kda: Callable[..., None]
    _attn_res: Callable[..., None]
    _route: Callable[..., None]
    _rms_norm: Callable[..., None]
    _mla: Callable[..., None]
    _situ: Callable[..., None]
    moe_rows: Callable[..., int]
    _gated_norm: Callable[..., None]
    kda_rows: Callable[..., None]
    _sigmoid_gate: Callable[..., None]
    mla_rows: Callable[..., None]
    _attn_res_norm: Callable[..., None]

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for attribute, (symbol, returns, arguments) in _ENTRIES.items():
            fn = getattr(lib, symbol)
            fn.restype = _C_TYPES[returns] if returns else None
            fn.argtypes = [_C_TYPES[a] for a in arguments]
            setattr(self, attribute, fn)

    def situ(self, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor | None:
        """`layers.situ` of float32 gate and up [T, n] (rows strided, columns contiguous); None for other layouts."""
        if gate.dim() != 2 or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
            return None
        rows, width = gate.shape
        out = torch.empty(rows, width, dtype=torch.float32)
        self._situ(rows, width, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), beta,
                   0.0 if linear_beta is None else linear_beta, out.data_ptr())
        return out

    def sigmoid_gate(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
        """MLA's output gate `x * sigmoid(g)` of x [T, n] (contiguous float32) and g [T, n] (columns
        contiguous, rows strided); None for other layouts."""
        if x.dim() != 2 or g.shape != x.shape or not x.is_contiguous() or g.stride(-1) != 1:
            return None
        rows, width = x.shape
        y = torch.empty(rows, width, dtype=torch.float32)
        self._sigmoid_gate(rows, width, x.data_ptr(), g.data_ptr(), g.stride(0), y.data_ptr())
        return y

    def gated_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       gate: torch.Tensor) -> torch.Tensor | None:
        """KDA's gated output norm `rms_norm(x, weight) * sigmoid(gate)` of x [T, H, D] (contiguous float32)
        and gate [T, H, D] (heads and columns contiguous, rows strided); None for other layouts."""
        rows, heads, dim = x.shape
        if (not x.is_contiguous() or not weight.is_contiguous() or gate.shape != x.shape or gate.stride(-1) != 1
                or gate.stride(-2) != dim):
            return None
        y = torch.empty(rows, heads, dim, dtype=torch.float32)
        self._gated_norm(rows, heads, dim, x.data_ptr(), weight.data_ptr(), eps, gate.data_ptr(), gate.stride(0),
                         y.data_ptr())
        return y

    def mla_attend(self, q: torch.Tensor, pages: torch.Tensor, index: torch.Tensor, starts: torch.Tensor,
                   lens: torch.Tensor, longest: int, w_uk: torch.Tensor, w_uv: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """Absorbed MLA attention of query rows q [R, H, nope+rope] (contiguous float32): row r over the
        cached latents pages[index[starts[r] : starts[r] + lens[r]]] (pages [slots, lora+rope], contiguous),
        with w_uk [H, nope, lora] and w_uv [H, v, lora] contiguous. Returns [R, H, v]."""
        rows, heads, qdim = q.shape
        nope, lora = w_uk.shape[1:]
        v_dim = w_uv.shape[1]
        out = torch.empty(rows, heads, v_dim, dtype=torch.float32)
        scratch = torch.empty(2 * rows * heads * lora + heads * max(1, longest), dtype=torch.float32)
        self._mla(rows, heads, nope, qdim - nope, lora, v_dim, q.data_ptr(), pages.data_ptr(), index.data_ptr(),
                  starts.data_ptr(), lens.data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(), scale, scratch.data_ptr(),
                  out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """`layers.rms_norm` of float32 x over its last dim (weight float32 or None); None when x's rows
        are not evenly strided with contiguous last dims (the caller keeps torch then)."""
        dim = x.shape[-1]
        if x.stride(-1) != 1 or (weight is not None and not weight.is_contiguous()):
            return None
        if x.is_contiguous():
            rows, step = x.numel() // dim if dim else 0, dim
        elif x.dim() == 2:
            rows, step = x.shape[0], x.stride(0)
        else:
            return None
        y = torch.empty(x.shape, dtype=torch.float32)
        self._rms_norm(rows, dim, x.data_ptr(), step, None if weight is None else weight.data_ptr(), eps, y.data_ptr())
        return y

    def route(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`moe.route` of float32 logits [T, E] (rows may be strided) and bias [E]: (weights [T, k], ids [T, k])."""
        rows, experts = logits.shape
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        weights = torch.empty(rows, top_k, dtype=torch.float32)
        ids = torch.empty(rows, top_k, dtype=torch.int64)
        self._route(rows, experts, logits.data_ptr(), logits.stride(0), bias.data_ptr(), top_k, int(renormalize),
                    scaling, weights.data_ptr(), ids.data_ptr())
        return weights, ids

    def attn_res(self, sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
        """`attnres.attn_res` of contiguous float32 sources [T, D] and a float32 query [D]: y [T, D]."""
        rows, dim = sources[0].shape
        out = torch.empty(rows, dim, dtype=torch.float32)
        pointers = (ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources))
        self._attn_res(len(sources), pointers, rows, dim, query.data_ptr(), eps, out.data_ptr())
        return out

    def attn_res_norm(self, sources: list[torch.Tensor], query: torch.Tensor, eps: float, weight: torch.Tensor,
                      norm_eps: float) -> torch.Tensor:
        """`rms_norm(self.attn_res(sources, query, eps), weight, norm_eps)` in one call, bitwise the two."""
        rows, dim = sources[0].shape
        out = torch.empty(rows, dim, dtype=torch.float32)
        scratch = torch.empty(rows, dim, dtype=torch.float32)
        pointers = (ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources))
        self._attn_res_norm(len(sources), pointers, rows, dim, query.data_ptr(), eps, weight.data_ptr(), norm_eps,
                            scratch.data_ptr(), out.data_ptr())
        return out

    def kda_decode(self, qkv: torch.Tensor, raw_gate: torch.Tensor, b_raw: torch.Tensor, kernel_t: torch.Tensor,
                   a_h: torch.Tensor | None, dt_bias: torch.Tensor, lower_bound: float | None,
                   conv_store: torch.Tensor, rec_store: torch.Tensor, slots: torch.Tensor,
                   spec: torch.Tensor | None, scale: float) -> torch.Tensor:
        """B sequences of T tokens (rows b*T + t): qkv [B*T, 3HK] pre-conv (rows contiguous), raw_gate
        [B*T, H*K] gate logits (or the log-decay when `a_h` is None), b_raw [B*T, H] beta logits,
        kernel_t [W, 3HK] the conv kernels transposed, slots [B] int64, spec [B, T-1] int64 or None.
        Updates the stores in place; returns o [B*T, H, V] float32."""
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        heads, k_dim, v_dim = rec_store.shape[1:]
        rows = qkv.shape[0]
        batch = slots.shape[0]
        tokens = rows // batch
        out = torch.empty(rows, heads, v_dim, dtype=torch.float32)
        self._kda(batch, tokens, heads, k_dim, v_dim, kernel_t.shape[0],
                  qkv.data_ptr(), qkv.stride(0), kernel_t.data_ptr(),
                  raw_gate.data_ptr(), None if a_h is None else a_h.data_ptr(), dt_bias.data_ptr(),
                  0.0 if lower_bound is None else lower_bound, b_raw.data_ptr(),
                  conv_store.data_ptr(), rec_store.data_ptr(), slots.data_ptr(),
                  None if spec is None else spec.data_ptr(), scale, out.data_ptr())
        return out


def _kda_reference(qkv: torch.Tensor, raw: torch.Tensor, b_raw: torch.Tensor, kernel: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, lower: float, conv: torch.Tensor, rec: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence token by token in plain torch, for the load-time check (kept apart from
    engine/model/kda_ops.py, which imports this module's users): qkv [B, T, 3HK] etc.; returns
    (o [B, T, H, K], conv states [B, T, W-1, C], recurrent states [B, T, H, K, K])."""
    batch, tokens, channels = qkv.shape
    heads, k_dim = rec.shape[1:3]
    outs, convs, recs = [], [], []
    for t in range(tokens):
        window = torch.cat([conv, qkv[:, t, None]], dim=1)                              # [B, W, C]
        mixed = torch.nn.functional.silu((window * kernel.t()).sum(1)).view(batch, 3, heads, k_dim)
        q, k, v = (mixed[:, i] for i in range(3))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * scale
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        z = raw[:, t].view(batch, heads, k_dim) + dt_bias.view(heads, -1)
        g = lower * torch.sigmoid(a_log.exp()[:, None] * z)
        rec = rec * g.exp()[..., None]
        delta = torch.sigmoid(b_raw[:, t])[..., None] * (v - (k[..., None] * rec).sum(-2))
        rec = rec + k[..., None] * delta[..., None, :]
        outs.append((q[..., None] * rec).sum(-2))
        conv = window[:, 1:]
        convs.append(conv)
        recs.append(rec)
    return torch.stack(outs, 1), torch.stack(convs, 1), torch.stack(recs, 1)


def _attn_res_reference(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    v = torch.stack(sources, dim=1)
    probs = torch.softmax((v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)) @ query, dim=-1)
    return (probs[:, None, :] @ v).squeeze(1)


def _agrees(ops: DecodeOps) -> bool:
    """KDA: two sequences of three tokens (verification, per-position states kept) against
    `_kda_reference` on scattered slots; RMSNorm, SiTU, routing and AttnRes on a few rows against
    their torch forms (MLA's attention is held to its torch path by the tests). A wrong build or ABI
    shows here, before any model output depends on it."""
    gen = torch.Generator().manual_seed(0)
    batch, tokens, heads, k_dim, width = 2, 3, 2, 8, 4
    channels = 3 * heads * k_dim
    qkv = torch.randn(batch, tokens, channels, generator=gen)
    raw = torch.randn(batch, tokens, heads * k_dim, generator=gen)
    b_raw = torch.randn(batch, tokens, heads, generator=gen)
    kernel = torch.randn(channels, width, generator=gen)
    a_log, dt_bias = torch.randn(heads, generator=gen) * 0.1, torch.randn(heads * k_dim, generator=gen)
    conv_store = torch.randn(9, width - 1, channels, generator=gen)
    rec_store = torch.randn(9, heads, k_dim, k_dim, generator=gen) * 0.1
    slots, spec = torch.tensor([5, 1]), torch.tensor([[2, 7], [0, 8]])
    want_o, want_conv, want_rec = _kda_reference(qkv, raw, b_raw, kernel, a_log, dt_bias, -5.0,
                                                 conv_store[slots], rec_store[slots], 0.35)
    got = ops.kda_decode(qkv.view(-1, channels), raw.view(-1, heads * k_dim), b_raw.view(-1, heads),
                         kernel.t().contiguous(), a_log.exp(), dt_bias, -5.0, conv_store, rec_store, slots, spec, 0.35)
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-5)
    x, w = torch.randn(3, 40, generator=gen) * 3, torch.randn(40, generator=gen)
    norm = ops.rms_norm(x, w, 1e-5)
    glu = ops.situ(x[:, :20], x[:, 20:], 4.0, 25.0)
    weights, ids = ops.route(x[:, :32], w[:32], 4, True, 2.5)
    scores = torch.sigmoid(x[:, :32])
    want_ids = torch.topk(scores + w[:32], 4, dim=-1).indices
    want_weights = scores.gather(-1, want_ids)
    g, u = x[:, :20].double(), x[:, 20:].double()
    return (norm is not None and close(norm, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))
            and glu is not None
            and close(glu.double(), 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25))
            and torch.equal(ids, want_ids)
            and close(weights, 2.5 * want_weights / want_weights.sum(-1, keepdim=True))
            and close(ops.attn_res([x, 2 * x + 1], w, 1e-5), _attn_res_reference([x, 2 * x + 1], w, 1e-5))
            and close(got.view(batch, tokens, heads, k_dim), want_o)
            and close(conv_store[slots], want_conv[:, -1]) and close(rec_store[slots], want_rec[:, -1])
            and close(conv_store[spec.reshape(-1)], want_conv[:, :-1].reshape(-1, width - 1, channels))
            and close(rec_store[spec.reshape(-1)], want_rec[:, :-1].reshape(-1, heads, k_dim, k_dim)))


@functools.cache
def decode_ops() -> DecodeOps | None:
    """The library, built and checked once per process; None (and one log line) where it is not used."""
    if switched_off(os.environ, ENABLE_ENV):
        log.info("decode ops off (%s=0): the decode step's small operators stay on torch", ENABLE_ENV)
        return None
    if rowdot.kernel() is None:                  # same platform rules and switch as the linears' kernels
        return None
    try:
        ops = DecodeOps(rowdot.build(source=SOURCE, extra=(rowdot.SOURCE,)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("decode ops unavailable, the decode step's small operators stay on torch: %s", exc)
        return None
    if not _agrees(ops):
        log.warning("decode ops disagree with the torch forms on their check; not used")
        return None
    return ops


_switched_on = True
LAYERS_ENV = "KIMI_PD_CPU_DECODE_LAYERS"
_layers_on = not switched_off(os.environ, LAYERS_ENV)


def set_enabled(on: bool) -> None:
    """Turn the decode ops on or off in this process from now on (in-process A/B runs:
    benchmarks/decode_ops_ab.py); `KIMI_PD_CPU_DECODE_OPS=0` is the operator's switch."""
    global _switched_on
    _switched_on = on


def usable(*tensors: torch.Tensor) -> DecodeOps | None:
    """The library when these tensors can go to it: float32 CPU, outside autograd and compiling. Any
    thread count: the C code runs on the calling thread, so a token takes it whatever the forward's
    size (plain decoding and verification agree)."""
    if not _switched_on or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return decode_ops()


def set_layers_enabled(on: bool) -> None:
    """Turn the whole-layer calls (`moe_rows`, `kda_rows`, `mla_rows`, `attn_res_norm`) on or off in this process from
    now on (in-process A/B runs, equivalence tests); `KIMI_PD_CPU_DECODE_LAYERS=0` is the operator's
    switch. The per-operator calls stay as `set_enabled` leaves them."""
    global _layers_on
    _layers_on = on


def layer_usable(*tensors: torch.Tensor) -> DecodeOps | None:
    """`usable`, for the whole-layer calls: also None when they are switched off."""
    return usable(*tensors) if _layers_on else None
