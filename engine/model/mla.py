"""Gated NoPE multi-head latent attention (docs/model.md, Gated NoPE MLA).

Cache per token: `[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]`, the normalised latent and the
un-rotated shared key slice. Two equivalent paths:
- compute-friendly (prefill): materialise per-head K/V from the cached latents with `kv_b_proj`;
- absorbed (decode): fold `W_UK` into the query and `W_UV` into the output, attend in latent space.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from engine.model import choices, decode_ops, rowdot
from engine.model.forward_batch import ForwardBatch, SequenceSlice, StaticDecode
from engine.model.fused import FUSED_ATTR, fuse_linears, project
from engine.model.gemm import Linear, panel_weight, row_major_weights, rowdot_now
from engine.model.layers import C_NORM_MAX_ELEMENTS, RMSNorm, cast, inference_cached, linear_weight, upcast
from shared.model_config import TextConfig


@dataclass(frozen=True)
class MLAOptions:
    """`auto`: the absorbed path for pieces of at most `absorb_max_tokens` new tokens."""

    mode: str = "auto"                  # auto | absorbed | materialized
    absorb_max_tokens: int = 8


class _MLARowsPlan(NamedTuple):
    """`mla_rows`' fixed arguments: the most rows it takes, the fused input weight, (q_lora, kv_lora, rope),
    the two latent norms, q_b's and o_proj's weights."""

    max_rows: int
    w_in: torch.Tensor
    sizes: tuple[int, int, int]
    q_norm: RMSNorm
    kv_norm: RMSNorm
    w_qb: torch.Tensor
    w_o: torch.Tensor


class GatedMLA(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, options: MLAOptions) -> None:
        super().__init__()
        self.layer_id, self.options = layer_id, options
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        latent_eps = cfg.rms_norm_eps if choices.MLA_LATENT_NORM_USES_RMS_NORM_EPS else 1e-6
        d, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, latent_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, latent_eps)
        self.kv_b_proj = Linear(self.kv_lora, nh * (self.nope + self.v_dim), bias=False)
        self.g_proj = Linear(d, nh * self.v_dim, bias=False)
        self.o_proj = Linear(nh * self.v_dim, d, bias=False)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache stores for tokens x: [N, kv_lora + rope]."""
        return self._latent_of(self.kv_a_proj_with_mqa(x))

    def _latent_of(self, kv_a: torch.Tensor) -> torch.Tensor:
        c, k_pe = kv_a.split([self.kv_lora, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def _input_linears(self) -> tuple[nn.Module, ...]:
        """Every projection of the layer input x, in the order `project` returns them."""
        return (self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj)

    def fuse_linears(self) -> None:
        """q_a/kv_a/g as one GEMM per weight kind (engine/model/fused.py); after any sharding."""
        fuse_linears(self, self._input_linears(), (1, 1, 1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [N, D] normalised layer input; writes the new latents into the pages, attends, gates."""
        if batch.decode is None and (y := self._rows_in_c(x, batch)) is not None:
            return y
        nh = self.num_heads
        q_a, kv_a, g = project(self, x, self._input_linears(), (1, 1, 1))
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(-1, nh, self.nope + self.rope)
        latent = self._latent_of(kv_a)
        pages = batch.cache.mla_pages[self.layer_id]
        flat_pages = pages.view(-1, pages.shape[-1])
        if batch.decode is not None:
            out = self._decode_static(q, latent, flat_pages, batch.decode)
        else:
            out = self._forward_slices(q, latent, flat_pages, batch)
        return self.o_proj(self._gated(out.reshape(x.shape[0], -1), g, x.dtype))

    def _gated(self, out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`out * sigmoid(g)` in `dtype`; float32 steps of at most C_NORM_MAX_ELEMENTS in one C call
        (engine/model/decode_ops.py; the same to rounding)."""
        if out.numel() <= C_NORM_MAX_ELEMENTS and dtype == torch.float32 and (ops := decode_ops.usable(out, g)):
            y = ops.sigmoid_gate(out.contiguous(), g)
            if y is not None:
                return y
        return out * cast(torch.sigmoid(upcast(g)), dtype)

    def _rows_in_c(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """A pure decode step's tokens (one per sequence, up to sixteen) through this layer in one C call
        (`decode_ops.c`'s `mla_rows`), where the Python path would make the same calls (fused float input
        projection, q_b and o_proj on the rowdot kernels, the C attention): bitwise its result
        (tests/engine/model/test_decode_layers.py). None elsewhere."""
        rows = x.shape[0]
        if (not batch.plain_decode or len(batch.slices) != rows or not self._use_absorbed(1)
                or self.options.mode == "materialized"):
            return None
        pages = batch.cache.mla_pages[self.layer_id]
        ops = decode_ops.layer_usable(x, pages)
        kernel = rowdot.kernel()
        if ops is None or kernel is None or not rowdot_now(x) or not pages.is_contiguous():
            return None
        plan = self._rows_plan()
        if plan is None or rows > plan.max_rows:
            return None
        w_in, sizes, q_norm, kv_norm, w_qb, w_o = plan.w_in, plan.sizes, plan.q_norm, plan.kv_norm, plan.w_qb, plan.w_o
        row_major = rowdot.row_major_max_rows()
        panels = ([panel_weight(w, kernel).data_ptr() for w in (w_in, w_qb, w_o)] if rows > row_major
                  else [None, None, None])
        _, write, index, starts, lens, longest = _c_attend_plan(list(range(rows)), batch)
        write = write.long()
        w_uk, w_uv = self._absorb_weights_contiguous()
        n_in, heads, v_dim, kl = w_in.shape[0], self.num_heads, self.v_dim, self.kv_lora
        scratch = torch.empty(rows * (n_in + sizes[0] + heads * (self.nope + self.rope) + 2 * heads * v_dim
                                      + 2 * heads * kl) + heads * max(1, longest), dtype=torch.float32)
        y = torch.empty(rows, w_o.shape[0], dtype=torch.float32)
        ops.mla_rows(rows, w_in.shape[1], *sizes, heads, self.nope, v_dim, row_major, x.contiguous().data_ptr(),
                     w_in.data_ptr(), panels[0], q_norm.weight.data_ptr(), q_norm.eps, w_qb.data_ptr(), panels[1],
                     kv_norm.weight.data_ptr(), kv_norm.eps, pages.data_ptr(), write.data_ptr(), index.data_ptr(),
                     starts.data_ptr(), lens.data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(), self.scale, w_o.data_ptr(),
                     panels[2], scratch.data_ptr(), y.data_ptr())
        return y

    def _rows_plan(self) -> _MLARowsPlan | None:
        """What `_rows_in_c` passes that is fixed per fusing, where the C call reproduces the Python path,
        else None; made again when the fusing changes."""
        fused = self.__dict__.get(FUSED_ATTR)
        key = id(fused)
        held = self.__dict__.get("_rows_plan_held")
        if held is not None and held[0] == key:
            return held[1]
        plan = None
        sizes = (self.q_a_proj.weight.shape[0], self.kv_lora, self.rope)
        if (fused is not None and len(fused.groups) == 1 and isinstance(fused.groups[0], Linear)
                and fused._split_sizes == [sizes[0], sizes[1] + sizes[2], self.num_heads * self.v_dim]
                and isinstance(self.q_b_proj, Linear) and isinstance(self.o_proj, Linear)
                and self.q_b_proj.bias is None and self.o_proj.bias is None
                and row_major_weights((fused.groups[0].weight, self.q_b_proj.weight, self.o_proj.weight))
                and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous()
                        for n in (self.q_a_layernorm, self.kv_a_layernorm))):
            plan = _MLARowsPlan(min(fused._max_rows, rowdot.linear_max_rows()), fused.groups[0].weight, sizes,
                                self.q_a_layernorm, self.kv_a_layernorm, self.q_b_proj.weight, self.o_proj.weight)
        self.__dict__["_rows_plan_held"] = (key, plan)
        return plan

    def _forward_slices(self, q: torch.Tensor, latent: torch.Tensor, flat_pages: torch.Tensor,
                        batch: ForwardBatch) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        ops = decode_ops.usable(q, flat_pages) if self.options.mode != "materialized" else None
        absorbed: list[int] = []
        if ops is not None and q.is_contiguous() and flat_pages.is_contiguous():
            absorbed = [i for i, s in enumerate(batch.slices)
                        if s.num_new_tokens and self._use_absorbed(s.num_new_tokens)]
        if ops is not None and absorbed:
            rows, write, index, starts, lens, longest = _c_attend_plan(absorbed, batch)
            flat_pages[write] = cast(latent[rows], flat_pages.dtype)
            w_uk, w_uv = self._absorb_weights_contiguous()
            out[rows] = cast(ops.mla_attend(q[rows], flat_pages, index, starts, lens, longest, w_uk, w_uv,
                                            self.scale), out.dtype)
            if len(absorbed) == sum(1 for s in batch.slices if s.num_new_tokens):
                return out
        return self._torch_slices(q, latent, flat_pages, batch, out, set(absorbed))

    def _absorb_weights_contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`_absorb_weights` as contiguous float32 tensors, for the C attention (kept for inference)."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            w_uk, w_uv = self._absorb_weights()
            return w_uk.float().contiguous(), w_uv.float().contiguous()
        return inference_cached(self, "_absorb_contiguous_cache", (self.kv_b_proj.weight,), build)

    def _torch_slices(self, q: torch.Tensor, latent: torch.Tensor, flat_pages: torch.Tensor, batch: ForwardBatch,
                      out: torch.Tensor, done: set[int]) -> torch.Tensor:
        """The slices not in `done`, on torch's operators: every one-token slice in one batched absorbed
        attention, every other piece on its own."""
        decode = ([i for i, s in enumerate(batch.slices) if s.num_new_tokens == 1 and i not in done]
                  if self._use_absorbed(1) else [])
        if len(decode) > 1:
            self._decode_batched(decode, q, latent, flat_pages, batch, out)
        batched = set(decode) if len(decode) > 1 else set()
        for i, (s, start) in enumerate(zip(batch.slices, batch.token_offsets, strict=False)):
            if not s.num_new_tokens or i in batched or i in done:
                continue
            rows = slice(start, start + s.num_new_tokens)
            write, read = _slice_slots(i, s, batch)
            flat_pages[write] = cast(latent[rows], flat_pages.dtype)
            context = cast(_rows(flat_pages, read), q.dtype)
            out[rows] = self._attend(q[rows], context, s.num_cached_tokens)
        return out

    def _decode_batched(self, idx: list[int], q: torch.Tensor, latent: torch.Tensor, flat_pages: torch.Tensor,
                        batch: ForwardBatch, out: torch.Tensor) -> None:
        """Every one-token slice in one absorbed attention over contexts padded to the longest (masked).

        The same arithmetic as `_attend` per sequence; the masked positions get probability exactly 0.
        """
        rows, index, valid, write = _decode_plan(idx, batch)
        flat_pages[write] = latent[rows].to(flat_pages.dtype)
        out[rows] = self._latent_attention(q[rows], _rows(flat_pages, index), valid, self._absorb_weights())

    def _decode_static(self, q: torch.Tensor, latent: torch.Tensor, flat_pages: torch.Tensor,
                       d: StaticDecode) -> torch.Tensor:
        """A capture-safe decode step (`StaticDecode`): every row one token, contexts masked over the
        whole block table, the absorbed weights frozen beforehand (`freeze_decode_weights`)."""
        weights = getattr(self, "_frozen_absorb", None)
        if weights is None:
            raise RuntimeError("a static decode step needs freeze_decode_weights() first")
        flat_pages[d.write_index] = latent.to(flat_pages.dtype)
        return self._latent_attention(q, _rows(flat_pages, d.page_index), d.valid, weights)

    def _latent_attention(self, q: torch.Tensor, context: torch.Tensor, valid: torch.Tensor,
                          weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Absorbed attention of one query token per row: q [B, H, nope+rope], context [B, L, kv_lora+rope],
        valid [B, L] -> [B, H, v_dim]."""
        c, k_pe = upcast(cast(context, q.dtype)).split([self.kv_lora, self.rope], dim=-1)               # [B, L, .]
        q_nope, q_pe = upcast(q).split([self.nope, self.rope], dim=-1)                               # [B, H, .]
        w_uk, w_uv = weights
        ql = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1)                                          # [B, H, kv_lora]
        scores = ql @ c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)                                # [B, H, L]
        probs = torch.softmax((scores * self.scale).masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        latent_out = (probs @ c).transpose(0, 1)                                                     # [H, B, kv_lora]
        return cast((latent_out @ w_uv.transpose(1, 2)).transpose(0, 1), q.dtype)

    def freeze_decode_weights(self) -> None:
        """Build the absorbed weights once for capture-safe decode steps (graphs read fixed weights)."""
        self._frozen_absorb = tuple(w.contiguous() for w in self._absorb_weights())

    def _use_absorbed(self, num_new: int) -> bool:
        mode = self.options.mode
        return mode == "absorbed" or (mode == "auto" and num_new <= self.options.absorb_max_tokens)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]) in the accumulation dtype.

        Kept for inference (`inference_cached`): upcasting (or dequantising a quantized kv_b_proj)
        every step re-read the whole matrix.
        """
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            w_kvb = upcast(linear_weight(self.kv_b_proj)).view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
            return w_kvb[:, : self.nope], w_kvb[:, self.nope:]
        return inference_cached(self, "_absorb_cache", (self.kv_b_proj.weight,), build)

    def _attend(self, q: torch.Tensor, context: torch.Tensor, num_cached: int) -> torch.Tensor:
        """q: [t, H, nope+rope]; context: [ctx+t, kv_lora+rope] -> [t, H, v_dim]; causal."""
        t, total = q.shape[0], context.shape[0]
        mask = None                   # the last token of the context sees all of it: nothing to mask
        if num_cached + t < total or t > 1:
            q_pos = torch.arange(num_cached, num_cached + t, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] > q_pos[:, None]      # [t, total]
        q_nope, q_pe = upcast(q).split([self.nope, self.rope], dim=-1)
        c, k_pe = upcast(context).split([self.kv_lora, self.rope], dim=-1)
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q_nope.transpose(0, 1), q_pe.transpose(0, 1)                   # [H, t, .]
        pe_scores = q_pe @ k_pe.t()                                                     # [H, t, total]
        if self._use_absorbed(t):
            ql = q_nope @ w_uk                                                          # [H, t, kv_lora]
            probs = torch.softmax(_masked((ql @ c.t() + pe_scores) * self.scale, mask), dim=-1)
            out = (probs @ c) @ w_uv.transpose(1, 2)                                    # latent out -> [H, t, v]
        else:
            k_nope = c @ w_uk.transpose(1, 2)                                           # [H, total, nope]
            v = c @ w_uv.transpose(1, 2)                                                # [H, total, v]
            scores = q_nope @ k_nope.transpose(1, 2) + pe_scores
            probs = torch.softmax(_masked(scores * self.scale, mask), dim=-1)
            out = probs @ v
        return cast(out.transpose(0, 1), q.dtype)


def _rows(flat_pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`flat_pages[index]` for an integer index of any shape, as one `index_select` (the same rows; advanced
    indexing costs ~7x more a call on CPU for the few hundred 288-wide rows of a decode step)."""
    return flat_pages.index_select(0, index.reshape(-1)).view(*index.shape, flat_pages.shape[-1])


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return scores if mask is None else scores.masked_fill(mask, float("-inf"))


def _slice_slots(i: int, s: SequenceSlice, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache slots of slice i's new tokens, of its whole context): the same for every MLA layer of a
    forward (they share block tables), so built once per batch."""
    memo = batch.__dict__.setdefault("_mla_slice_slots", {})
    slots = memo.get(i)
    if slots is None:
        bs = batch.cache.block_size
        pos = torch.arange(0, s.num_total_tokens, device=s.block_table.device)
        read = s.block_table[pos // bs] * bs + pos % bs
        slots = memo[i] = (read[s.num_cached_tokens:], read)
    return slots


def _c_attend_plan(idx: list[int], batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor, int]:
    """For the C attention of the slices `idx`: (token rows [R], their cache slots [R], every slice's
    context slots end to end, each row's start in them [R], each row's causal length [R], the longest).
    The same for every MLA layer of a forward, so built once per batch."""
    memo = batch.__dict__.setdefault("_mla_c_plans", {})
    key = tuple(idx)
    plan = memo.get(key)
    if plan is None:
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        writes: list[torch.Tensor] = []
        reads: list[torch.Tensor] = []
        offset = 0
        for i in idx:
            s = batch.slices[i]
            write, read = _slice_slots(i, s, batch)
            first = batch.token_offsets[i]
            rows.extend(range(first, first + s.num_new_tokens))
            writes.append(write)
            reads.append(read)
            starts.extend([offset] * s.num_new_tokens)
            lens.extend(range(s.num_cached_tokens + 1, s.num_cached_tokens + s.num_new_tokens + 1))
            offset += read.shape[0]
        plan = memo[key] = (torch.tensor(rows), torch.cat(writes), torch.cat(reads).long(),
                            torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64),
                            max(lens))
    return plan


def _decode_plan(idx: list[int], batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat rows [B], page index [B, L], valid [B, L], write index [B]) of the one-token slices `idx`.

    The same for every MLA layer of a forward (they share block tables), so it is built once per batch.
    """
    cached = batch._mla_decode_plan
    if cached is not None and cached[0] == idx:
        return cached[1]
    slices = [batch.slices[i] for i in idx]
    device = slices[0].block_table.device
    bs = batch.cache.block_size
    lens = torch.tensor([s.num_total_tokens for s in slices], device=device)
    longest = int(lens.max())
    tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in slices], batch_first=True)   # [B, nb]
    pos = torch.arange(longest, device=device)
    index = tables[:, (pos // bs).clamp(max=tables.shape[1] - 1)] * bs + pos % bs
    valid = pos[None, :] < lens[:, None]
    index = torch.where(valid, index, index[:, :1])          # padding reads a valid page, then is masked
    write = index[torch.arange(len(idx), device=device), lens - 1]
    rows = torch.tensor([batch.token_offsets[i] for i in idx], device=device)
    plan = (rows, index, valid, write)
    batch._mla_decode_plan = (list(idx), plan)
    return plan
