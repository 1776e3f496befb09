"""The capture-safe decode step: a pure decode batch as fixed-shape device tensors, and the forward
over them (`ForwardBatch.decode`).

A graph is keyed by `DecodeShape` (rows, block-table width). Every input is a tensor of exactly that
shape; the forward reads none of them on the host (MLA masks each row's context over the whole
width, KDA zeroes fresh rows by a mask, the MoE routes with a dense weight mask), so it can be
captured once and replayed with new values copied in. Padding rows decode a dummy token in the
scratch page and scratch KDA slot, starting fresh; their logits are dropped.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, StaticDecode


@dataclass(frozen=True, order=True)
class DecodeShape:
    rows: int           # the batch-size bucket
    blocks: int         # block-table width: contexts of up to blocks * block_size tokens

    def __str__(self) -> str:
        return f"{self.rows}x{self.blocks}"


def blocks_needed(batch: ForwardBatch, block_size: int) -> int:
    """Pages the longest sequence of a pure decode batch spans after this step."""
    return max(math.ceil(s.num_total_tokens / block_size) for s in batch.slices)


def build_inputs(input_ids: torch.Tensor, batch: ForwardBatch, shape: DecodeShape, scratch_block: int,
                 scratch_slot: int) -> dict[str, torch.Tensor]:
    """The static inputs of a pure decode batch padded to `shape`: lengths and slots from the slices'
    Python ints, block tables copied device to device (nothing is read back from the device)."""
    real, device = len(batch.slices), input_ids.device
    pad = shape.rows - real
    tables = torch.full((shape.rows, shape.blocks), scratch_block, dtype=torch.long, device=device)
    for row, s in enumerate(batch.slices):
        used = math.ceil(s.num_total_tokens / batch.cache.block_size)
        tables[row, :used] = s.block_table[:used]
    host = {
        "seq_lens": torch.tensor([s.num_total_tokens for s in batch.slices] + [1] * pad, dtype=torch.long),
        "kda_slots": torch.tensor([s.kda_slot for s in batch.slices] + [scratch_slot] * pad, dtype=torch.long),
        "fresh": torch.tensor([False] * real + [True] * pad),
    }
    ids = torch.cat([input_ids.reshape(-1).long(), torch.zeros(pad, dtype=torch.long, device=device)])
    return {"input_ids": ids, "block_tables": tables, **{k: v.to(device) for k, v in host.items()}}


def padding_inputs(shape: DecodeShape, scratch_block: int, scratch_slot: int,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """Inputs whose every row is padding: warm-up and capture write only to the scratch page and slot."""
    n = shape.rows
    return {"input_ids": torch.zeros(n, dtype=torch.long, device=device),
            "seq_lens": torch.ones(n, dtype=torch.long, device=device),
            "block_tables": torch.full((n, shape.blocks), scratch_block, dtype=torch.long, device=device),
            "kda_slots": torch.full((n,), scratch_slot, dtype=torch.long, device=device),
            "fresh": torch.ones(n, dtype=torch.bool, device=device)}


def decode_step(model, cache: HybridCacheTensors) -> Callable[..., torch.Tensor]:
    """`step(input_ids, seq_lens, block_tables, kda_slots, fresh) -> logits [rows, V]`: the function a
    graph captures. Call `model.freeze_decode_weights()` first."""

    def step(input_ids: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
             kda_slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        decode = StaticDecode(seq_lens, block_tables, kda_slots, fresh, cache.block_size)
        return model(input_ids, ForwardBatch([], cache, None, decode=decode))

    return step
