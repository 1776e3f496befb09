"""Padded decode == unpadded decode, through the engine (CPU: padding runs eager, as a replay would)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.graphs.config import CompilationConfig
from engine.graphs.decode import DecodePadding, enable_decode_padding, is_pure_decode
from tests.engine.core.helpers import record_step_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2, dtype="float64")
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(1, 9), (2, 14), (3, 5)]]




def recorded(llm: LLM):
    runner, padded = llm.engine.runner, []
    model = runner.model

    def forward(ids, batch):
        padded.append(len(batch.slices))
        return model.__class__.__call__(model, ids, batch)

    logits = record_step_logits(runner)
    runner.model = type("Spy", (), {"__call__": lambda self, ids, batch: forward(ids, batch)})()
    return logits, padded


def test_padded_decode_equals_unpadded(tiny_dir):
    plain = LLM(str(tiny_dir), **SETTINGS)
    ref_logits, ref_sizes = recorded(plain)
    ref = [o.output.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    padded = LLM(str(tiny_dir), **SETTINGS)
    graphs = enable_decode_padding(padded.engine.runner, 8, CompilationConfig("FULL_DECODE_ONLY"))
    logits, sizes = recorded(padded)
    got = [o.output.token_ids for o in padded.generate(PROMPTS, GREEDY)]
    assert got == ref
    assert len(logits) == len(ref_logits) and all(a.shape == b.shape for a, b in zip(logits, ref_logits, strict=False))
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=False)) < 1e-12
    assert 4 in sizes and 4 not in ref_sizes                 # 3 decoding sequences ran as a bucket of 4
    scratch = graphs.padding.scratch_block
    assert scratch == padded.engine.cache_config.num_blocks   # a page the cache manager never hands out
    padded.engine.check_integrity()


def test_only_pure_decode_batches_are_padded(tiny_dir):
    from engine.model.forward_batch import ForwardBatch, SequenceSlice
    table = torch.tensor([0])
    decode = ForwardBatch([SequenceSlice(1, 3, 0, table), SequenceSlice(1, 7, 1, table)], None, torch.tensor([0, 1]))
    assert is_pure_decode(decode)
    pad = DecodePadding((1, 4), scratch_block=9, scratch_slot=5)
    ids, batch, real = pad.pad(torch.tensor([11, 12]), decode)
    assert real == 2 and ids.tolist() == [11, 12, 0, 0] and batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert [(s.kda_slot, s.block_table.tolist(), s.reset_kda_state) for s in batch.slices[2:]] == [(5, [9], True)] * 2
    for other in (ForwardBatch([SequenceSlice(3, 0, 0, table)], None),                       # prefill chunk
                  ForwardBatch([SequenceSlice(1, 3, 0, table, snapshots=((1, 4),))], None),  # snapshot
                  ForwardBatch([SequenceSlice(1, 3, 0, table, spec_slots=(6,))], None)):     # verification
        assert not is_pure_decode(other) and pad.pad(torch.tensor([1]), other) is None
    assert DecodePadding((1, 2), 9, 5).pad(torch.tensor([1, 2, 3]), ForwardBatch(
        [SequenceSlice(1, 3, i, table) for i in range(3)], None)) is None        # larger than every bucket: eager


def test_cpu_engine_with_full_decode_only_runs_eager(tiny_dir):
    llm = LLM(str(tiny_dir), compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, **SETTINGS)
    assert llm.engine.runner.decode_graphs is None
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(str(tiny_dir), compilation_config='{"cudagraph_mode": "PIECEWISE"}', **SETTINGS)
