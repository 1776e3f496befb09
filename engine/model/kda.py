"""Kimi Delta Attention layer (docs/model.md, KDA): projections, short conv, gate, recurrence, gated norm."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model import choices, decode_ops, rowdot
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice, StaticDecode
from engine.model.fused import fuse_linears, project
from engine.model.gemm import Linear, panel_weight, row_major_weights, rowdot_now
from engine.model.kda_ops import (
    causal_conv_step,
    causal_conv_steps,
    causal_conv_with_state,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    kda_recurrent_states,
    kda_recurrent_step_,
)
from engine.model.layers import C_NORM_MAX_ELEMENTS, NormWeight, cast, inference_cached, l2norm, rms_norm, upcast
from shared.model_config import TextConfig


@dataclass(frozen=True)
class KDAOptions:
    """Which KDA form runs. `auto`: the recurrent form for short pieces, the chunked form otherwise."""

    chunk_size: int = 64
    mode: str = "auto"                  # auto | chunked | recurrent
    recurrent_max_tokens: int = 8


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, options: KDAOptions) -> None:
        super().__init__()
        lac = cfg.linear_attn_config
        self.layer_id, self.options = layer_id, options
        self.num_heads, self.head_dim = lac.num_heads, lac.head_dim
        self.lower_bound, self.eps = lac.gate_lower_bound, cfg.rms_norm_eps
        d, hk, w = cfg.hidden_size, lac.num_heads * lac.head_dim, lac.short_conv_kernel_size
        self.q_proj = Linear(d, hk, bias=False)
        self.k_proj = Linear(d, hk, bias=False)
        self.v_proj = Linear(d, hk, bias=False)
        self.q_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.k_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.v_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.f_a_proj = Linear(d, lac.head_dim, bias=False)
        self.f_b_proj = Linear(lac.head_dim, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(hk, dtype=torch.float32))
        # Stored like the real checkpoint: [head_dim], per-head values first, zero padding after.
        self.A_log = nn.Parameter(torch.zeros(lac.head_dim, dtype=torch.float32))
        self.b_proj = Linear(d, lac.num_heads, bias=False)
        self.g_proj = Linear(d, hk, bias=False)
        self.o_norm = NormWeight(lac.head_dim)
        self.o_proj = Linear(hk, d, bias=False)

    # ---- per-head parameters -----------------------------------------------------------------
    def head_a_log(self) -> torch.Tensor:
        if choices.A_LOG_PER_HEAD:
            return self.A_log[: self.num_heads]
        raise NotImplementedError("per-channel A_log reading is not implemented")

    def conv_weight(self) -> torch.Tensor:
        """q, k, v depthwise conv kernels concatenated along channels: [3*H*K, W].

        Kept for inference (`inference_cached`): serving concatenated them every step.
        """
        kernels = [m.weight for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        return inference_cached(self, "_conv_weight_cache", kernels,
                                lambda: torch.cat([w.squeeze(1) for w in kernels]))

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [N, D] normalised layer input of every new token; updates each slice's KDA state in place."""
        h, k = self.num_heads, self.head_dim
        qkv, f_a, b, gate = project(self, x, self._input_linears(), (3, 1, 1, 1))  # qkv [N, 3HK] pre-conv
        f_b = self.f_b_proj(f_a)
        if batch.decode is not None:
            out = self._decode_static(qkv, *self._gates(f_b, b), batch, batch.decode)
        else:
            row = self._rows_in_c(x, qkv, f_b, b, gate, batch)
            if row is not None:
                return row
            out = self._forward_slices(qkv, f_b, b, batch)
        y = self._gated_norm(out, gate.view(-1, h, k))
        return self.o_proj(cast(y, x.dtype).reshape(x.shape[0], h * k))

    def _gated_norm(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`rms_norm(out, o_norm) * sigmoid(gate)` over each head, [N, H, K]; float32 steps of at most
        C_NORM_MAX_ELEMENTS in one C call (engine/model/decode_ops.py; the same to rounding)."""
        if out.numel() <= C_NORM_MAX_ELEMENTS and (ops := decode_ops.usable(out, gate, self.o_norm.weight)) is not None:
            y = ops.gated_rms_norm(out, self.o_norm.weight, self.eps, gate)
            if y is not None:
                return y
        return upcast(rms_norm(out, self.o_norm.weight, self.eps)) * torch.sigmoid(upcast(gate))

    def _rows_in_c(self, x: torch.Tensor, qkv: torch.Tensor, f_b: torch.Tensor, b: torch.Tensor,
                   gate: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """A pure decode step's tokens (one per sequence, up to sixteen) after the input projections in one
        C call (`decode_ops.c`'s `kda_rows`: recurrence, gated norm, o_proj on the rowdot kernels), where the
        Python path would make the same calls: bitwise its result (tests/engine/model/test_decode_layers.py).
        None elsewhere."""
        rows = x.shape[0]
        if not batch.plain_decode or len(batch.slices) != rows:
            return None
        ops = decode_ops.layer_usable(x, f_b, self.o_norm.weight, self.dt_bias)
        kernel = rowdot.kernel()
        if ops is None or kernel is None or not rowdot_now(x) or not row_major_weights((self.o_proj.weight,)):
            return None
        conv_store, rec_store = batch.cache.kda_conv[self.layer_id], batch.cache.kda_recurrent[self.layer_id]
        step = qkv.stride(0)
        contiguous = (conv_store.is_contiguous() and rec_store.is_contiguous() and self.o_norm.weight.is_contiguous()
                      and qkv.stride(-1) == 1 and gate.stride(-1) == 1 and b.stride(-1) == 1
                      and (rows == 1 or gate.stride(0) == b.stride(0) == step))
        if (not contiguous or not isinstance(self.o_proj, Linear) or self.o_proj.bias is not None
                or self.head_dim > decode_ops.MAX_HEAD_DIM
                or conv_store.dtype != torch.float32 or rec_store.dtype != torch.float32):
            return None
        slots, _ = _c_slots(list(range(rows)), 1, batch)
        lower = self.lower_bound
        raw = f_b if lower is not None else kda_gate(
            f_b.view(-1, self.num_heads, self.head_dim), self.head_a_log(), self.dt_bias, None).view(f_b.shape)
        raw = raw.contiguous()
        heads, k_dim, v_dim = rec_store.shape[1:]
        kernel_t = self._conv_kernel_t()
        weight = self.o_proj.weight
        row_major = rowdot.row_major_max_rows()
        panels = panel_weight(weight, kernel).data_ptr() if rows > row_major else None
        y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        scratch = torch.empty(rows * (2 * heads * v_dim + heads), dtype=torch.float32)
        decay = self._head_decay_rate() if lower is not None else None
        ops.kda_rows(rows, heads, k_dim, v_dim, kernel_t.shape[0], qkv.data_ptr(), step, kernel_t.data_ptr(),
                     raw.data_ptr(), None if decay is None else decay.data_ptr(), self.dt_bias.data_ptr(),
                     0.0 if lower is None else lower, b.data_ptr(), conv_store.data_ptr(), rec_store.data_ptr(),
                     slots.data_ptr(), self.head_dim ** -0.5, gate.data_ptr(), self.o_norm.weight.data_ptr(), self.eps,
                     weight.data_ptr(), panels, weight.shape[0], row_major, scratch.data_ptr(), y.data_ptr())
        return y

    def _input_linears(self) -> tuple[nn.Module, ...]:
        """Every projection of the layer input x, in the order `project` returns them (q, k, v first,
        so the pre-conv q|k|v is one slice of the fused output)."""
        return (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_proj)

    def fuse_linears(self) -> None:
        """q/k/v/f_a/b/g as one GEMM per weight kind (engine/model/fused.py); after any sharding."""
        fuse_linears(self, self._input_linears(), (3, 1, 1, 1))

    def _gates(self, f_b: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-decay g [N, H, K], beta [N, H]) from the gate projection's output and the beta logits."""
        g = kda_gate(f_b.view(-1, self.num_heads, self.head_dim), self.head_a_log(), self.dt_bias, self.lower_bound)
        return g, torch.sigmoid(upcast(b))

    def _forward_slices(self, qkv, f_b, b, batch: ForwardBatch) -> torch.Tensor:
        h, k = self.num_heads, self.head_dim
        cache = batch.cache
        conv_store, rec_store = cache.kda_conv[self.layer_id], cache.kda_recurrent[self.layer_id]
        for s in batch.slices:
            if s.reset_kda_state:
                conv_store[s.kda_slot].zero_()
                rec_store[s.kda_slot].zero_()
        decode = [i for i, s in enumerate(batch.slices) if s.num_new_tokens == 1 and not s.snapshots]
        verify = [i for i, s in enumerate(batch.slices) if s.spec_slots]
        fits = k <= decode_ops.MAX_HEAD_DIM and conv_store.is_contiguous() and rec_store.is_contiguous()
        ops = decode_ops.usable(qkv, f_b, conv_store, rec_store) if fits else None
        if ops is not None and len(decode) == qkv.shape[0]:       # a pure decode batch: row i is slice i
            return self._decode_in_c(ops, qkv, f_b, b, batch, decode, 1)
        out = qkv.new_empty(qkv.shape[0], h, k, dtype=upcast(qkv).dtype)
        if ops is not None:
            for idx, tokens in [(decode, 1), *_by_length(verify, batch)]:
                if idx:
                    rows = _token_rows(idx, tokens, batch, qkv.device)
                    out[rows] = self._decode_in_c(ops, qkv[rows], f_b[rows], b[rows], batch, idx, tokens)
            done = set(decode) | set(verify)
            if all(i in done or not s.num_new_tokens for i, s in enumerate(batch.slices)):
                return out
        g, beta = self._gates(f_b, b)
        conv_w = self.conv_weight()
        if ops is None:
            if len(decode) == qkv.shape[0]:
                return self._decode_rows(qkv, g, beta, conv_w, batch, _decode_slots(decode, batch, qkv.device))
            if decode:
                self._decode_step(decode, qkv, g, beta, conv_w, batch, out)
            if verify:
                self._verify_steps(verify, qkv, g, beta, conv_w, batch, out)
        decode_set = set(decode) | set(verify)
        for i, s in enumerate(batch.slices):
            if i not in decode_set and s.num_new_tokens:
                self._sequence(s, batch.token_offsets[i], qkv, g, beta, conv_w, cache, out)
        return out

    def _decode_in_c(self, ops: decode_ops.DecodeOps, qkv, f_b, b, batch: ForwardBatch, idx: list[int],
                     tokens: int) -> torch.Tensor:
        """The slices `idx`, `tokens` new tokens each (rows slice by slice), through `kda_decode`: plain
        decoding (one token) and speculative verification (the state after each token but the last also
        kept in the slice's per-position slots), both updating the cache in place."""
        slots, spec = _c_slots(idx, tokens, batch)
        lower = self.lower_bound
        raw = f_b if lower is not None else kda_gate(
            f_b.view(-1, self.num_heads, self.head_dim), self.head_a_log(), self.dt_bias, None).view(f_b.shape)
        return ops.kda_decode(qkv, raw.contiguous(), upcast(b).contiguous(), self._conv_kernel_t(),
                              self._head_decay_rate() if lower is not None else None, self.dt_bias, lower,
                              batch.cache.kda_conv[self.layer_id], batch.cache.kda_recurrent[self.layer_id],
                              slots, spec, self.head_dim ** -0.5)

    def _conv_kernel_t(self) -> torch.Tensor:
        """The conv kernels as `kda_decode` reads them, [W, 3HK] (kept for inference)."""
        kernels = [m.weight for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        return inference_cached(self, "_conv_kernel_t_cache", kernels,
                                lambda: self.conv_weight().t().contiguous().float())

    def _head_decay_rate(self) -> torch.Tensor:
        """exp(A_log) per head, float32 (kept for inference)."""
        return inference_cached(self, "_decay_rate_cache", (self.A_log,),
                                lambda: upcast(self.head_a_log()).exp().float().contiguous())

    def _decode_static(self, qkv, g, beta, batch: ForwardBatch, d: StaticDecode) -> torch.Tensor:
        """A capture-safe decode step (`StaticDecode`): every row one token; a fresh row's state is
        zeroed by a mask, not a host branch; the conv kernels are frozen (`freeze_decode_weights`)."""
        conv_w = getattr(self, "_frozen_conv_weight", None)
        if conv_w is None:
            raise RuntimeError("a static decode step needs freeze_decode_weights() first")
        conv_store = batch.cache.kda_conv[self.layer_id]
        rec_store = batch.cache.kda_recurrent[self.layer_id]
        keep = ~d.fresh
        conv = conv_store[d.kda_slots] * keep[:, None, None].to(conv_store.dtype)
        rec = rec_store[d.kda_slots] * keep[:, None, None, None].to(rec_store.dtype)
        mixed, new_conv = causal_conv_step(qkv, conv_w, conv)
        conv_store[d.kda_slots] = new_conv
        q, k, v = self._split_qkv(mixed)
        o, new_rec = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], rec,
                                   self.head_dim ** -0.5)
        rec_store[d.kda_slots] = new_rec
        return o[:, 0]

    def freeze_decode_weights(self) -> None:
        """Concatenate the conv kernels once for capture-safe decode steps (graphs read fixed weights)."""
        self._frozen_conv_weight = self.conv_weight().contiguous()

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, k = self.num_heads, self.head_dim
        q, kk, v = upcast(mixed).view(*mixed.shape[:-1], 3, h, k).unbind(-3)
        return l2norm(q), l2norm(kk), v

    def _decode_step(self, idx: list[int], qkv, g, beta, conv_w, batch: ForwardBatch, out) -> None:
        """All one-token slices in one vectorised recurrent step."""
        rows = torch.tensor([batch.token_offsets[i] for i in idx], device=qkv.device)
        out[rows] = self._decode_rows(qkv[rows], g[rows], beta[rows], conv_w, batch,
                                      _decode_slots(idx, batch, qkv.device))

    def _decode_rows(self, qkv, g, beta, conv_w, batch: ForwardBatch, slots: torch.Tensor | slice) -> torch.Tensor:
        """One recurrent step for rows that are one token each of the sequences in KDA `slots`.

        Consecutive slots (a slice; always so at batch 1) are a view of the cache, updated in place;
        others are gathered and scattered back. Both give the same values bitwise."""
        conv_store = batch.cache.kda_conv[self.layer_id]
        rec_store = batch.cache.kda_recurrent[self.layer_id]
        mixed, new_conv = causal_conv_step(qkv, conv_w, conv_store[slots])
        conv_store[slots] = new_conv
        q, k, v = self._split_qkv(mixed)
        scale = self.head_dim ** -0.5
        if isinstance(slots, slice) and rec_store.dtype == torch.float32:
            return kda_recurrent_step_(q, k, v, g, beta, rec_store[slots], scale)
        o, new_rec = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                   rec_store[slots], scale)
        rec_store[slots] = new_rec
        return o[:, 0]

    def _verify_steps(self, idx: list[int], qkv, g, beta, conv_w, batch: ForwardBatch, out) -> None:
        """Speculative verification, vectorised over the verifying slices of equal length: plain
        decoding's per-token conv and recurrence arithmetic, bit for bit (`causal_conv_steps`,
        `kda_recurrent_states`), with the state after each token but the last kept in the slice's
        per-position slot and the last as the working state."""
        by_len: dict[int, list[int]] = {}
        for i in idx:
            by_len.setdefault(batch.slices[i].num_new_tokens, []).append(i)
        conv_store = batch.cache.kda_conv[self.layer_id]
        rec_store = batch.cache.kda_recurrent[self.layer_id]
        for t_len, group in by_len.items():
            starts = torch.tensor([batch.token_offsets[i] for i in group], device=qkv.device)
            rows = starts[:, None] + torch.arange(t_len, device=qkv.device)                # [B, T]
            slots = torch.tensor([batch.slices[i].kda_slot for i in group], device=qkv.device)
            mixed, conv_states = causal_conv_steps(qkv[rows], conv_w, conv_store[slots])   # [B, T, W-1, C]
            q, k, v = self._split_qkv(mixed)                                               # [B, T, H, K]
            o, rec_states = kda_recurrent_states(q, k, v, g[rows], beta[rows], rec_store[slots],
                                                 self.head_dim ** -0.5)                    # [T, B, H, K, V]
            out[rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            conv_store[slots], rec_store[slots] = conv_states[:, -1], rec_states[-1]
            spec = torch.tensor([batch.slices[i].spec_slots for i in group], device=qkv.device)   # [B, T-1]
            if spec.numel():
                positions = conv_states[:, :-1].transpose(0, 1)                          # [T-1, B, W-1, C]
                conv_store[spec.t().reshape(-1)] = positions.reshape(-1, *conv_states.shape[2:])
                rec_store[spec.t().reshape(-1)] = rec_states[:-1].reshape(-1, *rec_states.shape[2:])

    def _sequence(self, s: SequenceSlice, start: int, qkv, g, beta, conv_w,
                  cache: HybridCacheTensors, out) -> None:
        """One sequence's new tokens, split at snapshot points so each snapshot sees exact state."""
        conv_store = cache.kda_conv[self.layer_id]
        rec_store = cache.kda_recurrent[self.layer_id]
        cuts = sorted({k for k, _ in s.snapshots} | {s.num_new_tokens})
        lo = 0
        for hi in cuts:
            sl = slice(start + lo, start + hi)
            mixed, conv_store[s.kda_slot] = causal_conv_with_state(qkv[sl], conv_w, conv_store[s.kda_slot])
            q, k, v = self._split_qkv(mixed)
            o, rec_store[s.kda_slot] = self._recurrence(q, k, v, g[sl], beta[sl], rec_store[s.kda_slot])
            out[sl] = o
            for point, slot in s.snapshots:
                if point == hi:
                    conv_store[slot] = conv_store[s.kda_slot]
                    rec_store[slot] = rec_store[s.kda_slot]
            lo = hi

    def _recurrence(self, q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
        opts, scale = self.options, self.head_dim ** -0.5
        use_recurrent = opts.mode == "recurrent" or (opts.mode == "auto" and q.shape[0] <= opts.recurrent_max_tokens)
        if use_recurrent:
            o, s = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None], scale)
            return o[0], s[0]
        return kda_chunked(q, k, v, g, beta, state, scale, opts.chunk_size)


def _by_length(idx: list[int], batch: ForwardBatch) -> list[tuple[list[int], int]]:
    """The verifying slices `idx` grouped by their number of new tokens."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(batch.slices[i].num_new_tokens, []).append(i)
    return [(group, tokens) for tokens, group in groups.items()]


def _token_rows(idx: list[int], tokens: int, batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """The rows of the slices `idx`' new tokens, slice by slice: [len(idx) * tokens]."""
    starts = torch.tensor([batch.token_offsets[i] for i in idx], device=device)
    return (starts[:, None] + torch.arange(tokens, device=device)).reshape(-1)


def _c_slots(idx: list[int], tokens: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KDA slots [B], per-position slots [B, tokens-1] or None) of the slices `idx`, as int64 tensors:
    the same for every KDA layer of a forward, so built once per batch."""
    memo = batch.__dict__.setdefault("_kda_c_slots", {})
    key = (tuple(idx), tokens)
    hit = memo.get(key)
    if hit is None:
        slots = torch.tensor([batch.slices[i].kda_slot for i in idx], dtype=torch.int64)
        spec = (torch.tensor([batch.slices[i].spec_slots for i in idx], dtype=torch.int64).reshape(len(idx), tokens - 1)
                if tokens > 1 else None)
        hit = memo[key] = (slots, spec)
    return hit


def _decode_slots(idx: list[int], batch: ForwardBatch, device: torch.device) -> torch.Tensor | slice:
    """The KDA slots of the one-token slices `idx` (a slice when they are consecutive): the same for
    every KDA layer of a forward, so built once per batch."""
    cached = batch._kda_decode_slots
    if cached is not None and cached[0] == idx:
        return cached[1]
    ids = [batch.slices[i].kda_slot for i in idx]
    consecutive = all(b == a + 1 for a, b in zip(ids, ids[1:], strict=False))
    slots = slice(ids[0], ids[-1] + 1) if consecutive else torch.tensor(ids, device=device)
    batch._kda_decode_slots = (list(idx), slots)
    return slots
