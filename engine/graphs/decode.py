"""The engine's decode step under `FULL_DECODE_ONLY`: pure decode batches padded to a bucket.

Padding sequences decode one token each against a scratch MLA page and a scratch KDA slot that the
cache manager never hands out (the runner's cache gets one extra of each), so real sequences'
outputs are exactly those of the unpadded batch; their logits rows are dropped.

Graph replay needs a decode forward whose every shape and index is a device tensor of the bucket's
size. The model's decode forward is not yet capture-safe (MLA attends per sequence with host-side
context lengths; MoE routing reads the chosen experts back to the host), so `model.graph_safe_decode`
is absent and a device with graphs runs eager, logging why. `StaticGraphs` is the capture layer a
capture-safe decode plugs into.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine.graphs.buckets import bucket_for, capture_sizes
from engine.graphs.capture import graph_backend
from engine.graphs.config import CompilationConfig
from engine.model.forward_batch import ForwardBatch, SequenceSlice

log = logging.getLogger(__name__)


def is_pure_decode(batch: ForwardBatch) -> bool:
    """One new token per sequence after some context, nothing else (no snapshots, drafts, images)."""
    return bool(batch.slices) and batch.mm_embeds is None and all(
        s.num_new_tokens == 1 and s.num_cached_tokens > 0 and not s.snapshots and not s.spec_slots
        and not s.reset_kda_state for s in batch.slices) and (
        batch.logits_indices is None or batch.logits_indices.numel() == len(batch.slices))


class DecodePadding:
    """Pads pure decode batches to the bucket sizes; owns the scratch page and slot indices."""

    def __init__(self, sizes: tuple[int, ...], scratch_block: int, scratch_slot: int) -> None:
        self.sizes, self.scratch_block, self.scratch_slot = sizes, scratch_block, scratch_slot

    def pad(self, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, ForwardBatch, int] | None:
        """(padded ids, padded batch, real rows), or None when the batch is not padded."""
        if not is_pure_decode(batch):
            return None
        real = len(batch.slices)
        bucket = bucket_for(real, self.sizes)
        if bucket is None:
            return None
        device = input_ids.device
        table = torch.tensor([self.scratch_block], device=device)
        # a padding row starts a fresh sequence in the scratch page and slot: one token, no context
        pads = [SequenceSlice(1, 0, self.scratch_slot, table, reset_kda_state=True) for _ in range(bucket - real)]
        ids = torch.cat([input_ids, torch.zeros(bucket - real, dtype=input_ids.dtype, device=device)])
        indices = torch.arange(bucket, device=device)
        if batch.logits_indices is not None:
            indices = torch.cat([batch.logits_indices, torch.arange(real, bucket, device=device)])
        padded = ForwardBatch(batch.slices + pads, batch.cache, indices, None, None,
                              capture_layers=batch.capture_layers)
        return ids, padded, real


class DecodeGraphs:
    """What `run_model` calls for every forward when decode padding (and, later, replay) is on."""

    def __init__(self, padding: DecodePadding) -> None:
        self.padding = padding

    def forward(self, model, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        padded = self.padding.pad(input_ids, batch)
        if padded is None:
            return model(input_ids, batch)
        ids, pbatch, real = padded
        logits = model(ids, pbatch)
        batch.captured = [c[:real] for c in pbatch.captured]
        return logits[:real]


def enable_decode_padding(runner, max_num_seqs: int, compilation: CompilationConfig) -> DecodeGraphs:
    """Give the runner a scratch page and slot (one more of each; the cache is still empty) and pad."""
    cfg = runner.cache_config
    num_slots = runner.spec_slot_base + cfg.num_working_slots * cfg.spec_slots_per_seq
    runner.cache = runner._allocate_cache(dataclasses.replace(cfg, num_blocks=cfg.num_blocks + 1), num_slots + 1)
    sizes = capture_sizes(max_num_seqs, compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size)
    runner.decode_graphs = DecodeGraphs(DecodePadding(sizes, cfg.num_blocks, num_slots))
    return runner.decode_graphs


def setup_decode_graphs(runner, model, device: str, max_num_seqs: int, compilation: CompilationConfig,
                        enforce_eager: bool) -> DecodeGraphs | None:
    """The engine's choice: graphs only when asked for, not enforced eager, and possible here."""
    if not compilation.wants_graphs(enforce_eager):
        return None
    backend = graph_backend(device)
    if backend is None:
        log.info("cudagraph_mode FULL_DECODE_ONLY: %s has no graph support here; decode runs eager", device)
        return None
    if not getattr(model, "graph_safe_decode", False):
        log.warning("cudagraph_mode FULL_DECODE_ONLY: this model's decode forward is not capture-safe yet "
                    "(per-sequence MLA, host-side MoE routing); decode runs eager on %s", backend.name)
        return None
    return enable_decode_padding(runner, max_num_seqs, compilation)
