"""What one model forward needs to know about the sequences in it, and where their state lives.

The model runs a flattened batch: the new tokens of every sequence back to back (`input_ids [N]`).
Token-wise parts (embedding, AttnRes, MoE, norms) ignore sequence boundaries; the two mixers use
`SequenceSlice`s to find each sequence's tokens and state:

    flat tokens:  | seq0 new tokens | seq1 new tokens | ... |
    MLA pages:    pages[layer][block, offset, :]  <- block_table[pos // block_size], pos % block_size
    KDA state:    conv[layer][slot] [W-1, 3*H*K],  recurrent[layer][slot] [H, K, V] (fp32)

`HybridCacheTensors` only holds storage; who owns which block or slot is the cache manager's business.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.model_config import TextConfig


@dataclass
class SequenceSlice:
    """One sequence's share of a forward pass.

    num_cached_tokens: MLA context already written for this sequence before this pass (prefix hit,
      earlier chunks, imported state); the new tokens take positions num_cached..num_cached+new-1.
    kda_slot: row of the KDA state tensors holding this sequence's state; updated in place.
    reset_kda_state: zero that row first (a sequence starting from token 0).
    snapshots: (k, slot) pairs: after the first k new tokens, copy the KDA state into `slot`
      (prefix-cache snapshots at block boundaries); k in 1..num_new_tokens.
    spec_slots: speculative verification: the KDA state after new token k (k = 1..num_new-1) goes
      to `spec_slots[k-1]` (docs/dspark.md, KDA state on rejection), so a rejection restores it exactly.
    """

    num_new_tokens: int
    num_cached_tokens: int
    kda_slot: int
    block_table: torch.Tensor
    reset_kda_state: bool = False
    snapshots: tuple[tuple[int, int], ...] = ()
    spec_slots: tuple[int, ...] = ()

    @property
    def num_total_tokens(self) -> int:
        return self.num_cached_tokens + self.num_new_tokens


@dataclass
class HybridCacheTensors:
    """Storage for every sequence's hybrid state, indexed by model layer id."""

    block_size: int
    mla_pages: dict[int, torch.Tensor]
    kda_conv: dict[int, torch.Tensor]
    kda_recurrent: dict[int, torch.Tensor]

    @classmethod
    def allocate(cls, cfg: TextConfig, num_blocks: int, num_slots: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> HybridCacheTensors:
        lac = cfg.linear_attn_config
        conv_shape = (num_slots, lac.short_conv_kernel_size - 1, 3 * cfg.kda_projection_size)
        rec_shape = (num_slots, lac.num_heads, lac.head_dim, lac.head_dim)
        rec_dtype = torch.float64 if dtype == torch.float64 else torch.float32   # fp32 unless an fp64 oracle run
        return cls(
            block_size=block_size,
            mla_pages={i: torch.zeros(num_blocks, block_size, cfg.mla_cache_dim, dtype=dtype, device=device)
                       for i in cfg.mla_layer_ids},
            kda_conv={i: torch.zeros(conv_shape, dtype=dtype, device=device) for i in cfg.kda_layer_ids},
            kda_recurrent={i: torch.zeros(rec_shape, dtype=rec_dtype, device=device) for i in cfg.kda_layer_ids},
        )

    def nbytes(self) -> int:
        tensors = [*self.mla_pages.values(), *self.kda_conv.values(), *self.kda_recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StaticDecode:
    """A pure decode step (one new token per row) as device tensors of fixed shapes: what a captured
    decode graph replays (engine/graphs). Nothing in it is ever read back on the host, so a forward
    driven by it has no host syncs and no data-dependent Python branches.

    Rows are the flat tokens in order. Contexts are masked over the whole block table: every row
    attends over `block_tables.shape[1] * block_size` positions, the ones at or past its length masked.
    """

    seq_lens: torch.Tensor          # [B] long: tokens of the row after this step (>= 1)
    block_tables: torch.Tensor      # [B, nb] long: the row's pages, padded with any valid page id
    kda_slots: torch.Tensor         # [B] long: the row's KDA state slot
    fresh: torch.Tensor             # [B] bool: the row starts from an empty KDA state (padding rows)
    block_size: int
    page_index: torch.Tensor = field(init=False)   # [B, nb*bs] flat page slot of every context position
    valid: torch.Tensor = field(init=False)        # [B, nb*bs] position < seq_len
    write_index: torch.Tensor = field(init=False)  # [B] flat page slot of the new token's latent

    def __post_init__(self) -> None:
        bs, nb = self.block_size, self.block_tables.shape[1]
        pos = torch.arange(nb * bs, device=self.block_tables.device)
        index = self.block_tables[:, pos // bs] * bs + pos % bs
        self.write_index = index.gather(1, (self.seq_lens - 1)[:, None]).squeeze(1)
        self.valid = pos[None, :] < self.seq_lens[:, None]
        self.page_index = torch.where(self.valid, index, index[:, :1])   # masked positions read the first page


@dataclass
class ForwardBatch:
    """A flattened forward: slices in token order, the cache storage, and what to return.

    With `decode` set, the forward is a capture-safe decode step described by device tensors only
    (`StaticDecode`); `slices` is then empty.

    logits_indices: flat token positions whose logits are wanted (None = all).
    mm_embeds / mm_positions: image features `[M, D]` that replace the embeddings at flat
      positions `mm_positions [M]` (the `<|media_pad|>` tokens of this pass).
    """

    slices: list[SequenceSlice]
    cache: HybridCacheTensors
    logits_indices: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    mm_positions: torch.Tensor | None = None
    capture_layers: tuple[int, ...] = ()            # what the draft reads (docs/dspark.md, Target features)
    captured: list[torch.Tensor] = field(default_factory=list)
    decode: StaticDecode | None = None              # set: a capture-safe pure decode step (slices unused)
    token_offsets: list[int] = field(init=False)
    # every slice one new token of a running sequence (no snapshot, verification or KDA reset): the
    # whole-layer C calls' case (engine/model/decode_ops.py), decided once per forward
    plain_decode: bool = field(init=False)
    # built once per forward, shared by every layer of a kind: (slice indices, MLA decode plan / KDA slots)
    _mla_decode_plan: tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] | None = field(
        default=None, init=False, repr=False)
    _kda_decode_slots: tuple[list[int], torch.Tensor | slice] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        offsets, pos = [], 0
        for s in self.slices:
            offsets.append(pos)
            pos += s.num_new_tokens
        self.token_offsets = offsets
        self.plain_decode = bool(self.slices) and all(
            s.num_new_tokens == 1 and not (s.snapshots or s.spec_slots or s.reset_kda_state) for s in self.slices)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.slices)
