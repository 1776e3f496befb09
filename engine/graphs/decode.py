"""The engine's decode step under `FULL_DECODE_ONLY`: pure decode batches padded to a bucket and,
where the device has graphs, replayed from a captured graph.

Padding sequences decode one token each against a scratch MLA page and a scratch KDA slot that the
cache manager never hands out (the runner's cache gets one extra of each), so real sequences'
outputs are exactly those of the unpadded batch; their logits rows are dropped.

With a replayer (`DecodeGraphs.replay`), a pure decode batch becomes the fixed-shape inputs of the
capture-safe step (`static_decode.py`) for its (batch bucket, context width) shape and is replayed:
`StaticGraphs` on CUDA/NPU (captured lazily, once per shape), `EagerReplay` / `CompiledReplay` to run
the same step on a CPU (tests: the step equals the eager forward; torch.compile(fullgraph=True)
proves it has no graph breaks, so no host syncs). Anything else runs the eager forward.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from engine.graphs.buckets import bucket_for, capture_sizes, context_bucket, context_ladder
from engine.graphs.capture import StaticGraphs, graph_backend
from engine.graphs.config import CompilationConfig
from engine.graphs.static_decode import DecodeShape, blocks_needed, build_inputs, decode_step, padding_inputs
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


class EagerReplay:
    """Runs the capture-safe step as it is (a CPU stand-in for a graph: same inputs, same maths)."""

    def __init__(self, step: Callable[..., torch.Tensor]) -> None:
        self.step = step

    def run(self, key: DecodeShape, **inputs: torch.Tensor) -> torch.Tensor:
        return self.step(**inputs)


class CompiledReplay(EagerReplay):
    """The capture-safe step under `torch.compile(fullgraph=True)`: any host sync or data-dependent
    branch is a graph break, which fullgraph turns into an error. One static compile per shape."""

    def __init__(self, step: Callable[..., torch.Tensor], backend: str = "eager") -> None:
        super().__init__(torch.compile(step, fullgraph=True, dynamic=False, backend=backend))


class DecodeGraphs:
    """What `run_model` calls for every forward when decode padding (and replay) is on."""

    def __init__(self, padding: DecodePadding, widths: tuple[int, ...] = (), replay: Any = None) -> None:
        self.padding, self.widths, self.replay = padding, widths, replay
        self.replays: Counter[DecodeShape] = Counter()        # steps replayed, per shape

    def forward(self, model, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.replay is not None and not batch.capture_layers:
            logits = self._replayed(input_ids, batch)
            if logits is not None:
                return logits
        padded = self.padding.pad(input_ids, batch)
        if padded is None:
            return model(input_ids, batch)
        ids, pbatch, real = padded
        logits = model(ids, pbatch)
        batch.captured = [c[:real] for c in pbatch.captured]
        return logits[:real]

    def _replayed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        if not is_pure_decode(batch):
            return None
        rows = bucket_for(len(batch.slices), self.padding.sizes)
        blocks = context_bucket(blocks_needed(batch, batch.cache.block_size), self.widths)
        if rows is None or blocks is None:
            return None
        shape = DecodeShape(rows, blocks)
        inputs = build_inputs(input_ids, batch, shape, self.padding.scratch_block, self.padding.scratch_slot)
        logits = self.replay.run(shape, **inputs)
        self.replays[shape] += 1
        real = len(batch.slices)
        batch.captured = []
        out = logits[:real]
        return (out if batch.logits_indices is None else out[batch.logits_indices]).clone()


def enable_decode_padding(runner, max_num_seqs: int, compilation: CompilationConfig) -> DecodeGraphs:
    """Give the runner a scratch page and slot (one more of each; the cache is still empty) and pad."""
    cfg = runner.cache_config
    num_slots = runner.spec_slot_base + cfg.num_working_slots * cfg.spec_slots_per_seq
    runner.cache = runner._allocate_cache(dataclasses.replace(cfg, num_blocks=cfg.num_blocks + 1), num_slots + 1)
    sizes = capture_sizes(max_num_seqs, compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size)
    runner.decode_graphs = DecodeGraphs(DecodePadding(sizes, cfg.num_blocks, num_slots))
    return runner.decode_graphs


def enable_decode_replay(runner, model, max_num_seqs: int, compilation: CompilationConfig,
                         replayer: Callable[[Callable[..., torch.Tensor], Callable[[DecodeShape], dict]], Any]
                         ) -> DecodeGraphs:
    """Padding plus replay of the capture-safe step. `replayer(step, make_inputs)` builds the replayer:
    `StaticGraphs` on a graph device, `EagerReplay` / `CompiledReplay` on a CPU."""
    graphs = enable_decode_padding(runner, max_num_seqs, compilation)
    model.freeze_decode_weights()
    pad = graphs.padding
    graphs.widths = context_ladder(runner.cache_config.num_blocks)
    graphs.replay = replayer(decode_step(model, runner.cache),
                             lambda shape: padding_inputs(shape, pad.scratch_block, pad.scratch_slot, runner.device))
    return graphs


def setup_decode_graphs(runner, model, device: str, max_num_seqs: int, compilation: CompilationConfig,
                        enforce_eager: bool) -> DecodeGraphs | None:
    """The engine's choice: graphs only when asked for, not enforced eager, and possible here."""
    if not compilation.wants_graphs(enforce_eager):
        return None
    backend = graph_backend(device)
    if backend is None:
        log.info("cudagraph_mode FULL_DECODE_ONLY: %s has no graph support here; decode runs eager", device)
        return None
    if getattr(runner, "capture_layers", ()):
        log.warning("cudagraph_mode FULL_DECODE_ONLY: a speculative draft reads the target's hidden states; "
                    "decode runs eager")
        return None
    graphs = enable_decode_replay(runner, model, max_num_seqs, compilation,
                                  lambda step, make_inputs: StaticGraphs(backend, step, make_inputs))
    log.info("cudagraph_mode FULL_DECODE_ONLY on %s: decode graphs for batch sizes %s, context widths %s blocks "
             "(captured on first use)", backend.name, graphs.padding.sizes, graphs.widths)
    return graphs
