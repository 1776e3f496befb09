"""The capture-safe decode step (what a CUDA/NPU graph captures), on a CPU.

- through the engine, the static step (padded to a batch bucket, contexts masked over a width
  bucket, MoE by dense routing mask) gives the eager forward's logits within 1e-12 in fp64;
- `torch.compile(fullgraph=True)` of that step succeeds, and gives the same logits, across a width
  bucket: a host sync (`.item()`, `.tolist()`, `nonzero`) or a branch on a tensor value would be a
  graph break, which fullgraph turns into an error (the dispatch MoE, which reads its routing on the
  host, fails);
- the input building and bucket policies as pure functions.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.graphs.buckets import context_bucket, context_ladder
from engine.graphs.config import CompilationConfig
from engine.graphs.decode import CompiledReplay, EagerReplay, enable_decode_replay
from engine.graphs.static_decode import DecodeShape, blocks_needed, build_inputs
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from tests.engine.core.helpers import record_step_logits

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2, dtype="float64")
# lengths so that the running batch shrinks 5 -> 3 -> 2 (buckets 8, 4, 2) and contexts cross 8 pages
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in
           [(1, 9), (2, 14), (3, 5), (4, 30), (5, 17)]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 10, 4, 7, 10)]




def run(model_dir, replayer=None, prompts=PROMPTS, params=PARAMS):
    llm = LLM(str(model_dir), **SETTINGS)
    graphs = None
    if replayer is not None:
        graphs = enable_decode_replay(llm.engine.runner, llm.engine.model, 8, CompilationConfig("FULL_DECODE_ONLY"),
                                      lambda step, make_inputs: replayer(step))
    runner = llm.engine.runner
    logits = record_step_logits(runner)
    tokens = [o.output.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    return tokens, logits, graphs


@pytest.fixture(scope="module")
def eager(tiny_dir):
    return run(tiny_dir)


def assert_same_steps(got, reference) -> None:
    (tokens, logits, _), (ref_tokens, ref_logits, _) = got, reference
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(a.shape == b.shape for a, b in zip(logits, ref_logits, strict=False))
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=False)) < 1e-12


def test_static_decode_step_equals_eager_forward(tiny_dir, eager):
    got = run(tiny_dir, EagerReplay)
    assert_same_steps(got, eager)
    shapes = set(got[2].replays)
    assert {s.rows for s in shapes} == {8, 4, 2}, shapes            # padded to three batch buckets
    assert {s.blocks for s in shapes} >= {8, 16}, shapes            # contexts crossed a width bucket
    assert sum(got[2].replays.values()) >= 8


def test_fullgraph_compiled_step_equals_eager_forward(tiny_dir):
    """The same step under fullgraph: two sequences whose context crosses a width bucket, so two static
    compiles (each costs ~7 s of tracing on 2 cores; the batch buckets differ only in a size, which the
    eager-step test above covers)."""
    prompts, params = PROMPTS[3:], [PARAMS[4]] * 2         # finish together: no one-row step
    got = run(tiny_dir, CompiledReplay, prompts, params)
    assert_same_steps(got, run(tiny_dir, None, prompts, params))
    shapes = set(got[2].replays)
    assert {s.blocks for s in shapes} == {8, 16} and len(shapes) == 2, shapes
    assert sum(got[2].replays.values()) >= 8


def test_dispatch_moe_breaks_fullgraph_and_dense_routing_does_not(tiny_dir):
    """The check can fail: the eager MoE reads its chosen experts on the host (a graph break)."""
    llm = LLM(str(tiny_dir), **SETTINGS)
    moe = llm.engine.model.language_model.model.layers[1].block_sparse_moe
    x = torch.randn(5, moe.gate.weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        dispatch = moe(x)
        with pytest.raises(Exception, match="(?i)graph break|unsupported|data.dependent|tolist|item"):
            torch.compile(lambda t: moe(t, False), fullgraph=True, dynamic=False, backend="eager")(x)
        torch._dynamo.reset()
        dense = torch.compile(lambda t: moe(t, True), fullgraph=True, dynamic=False, backend="eager")(x)
    assert float((dense - dispatch).abs().max()) < 1e-12


def test_static_step_without_frozen_weights_is_refused(tiny_dir):
    llm = LLM(str(tiny_dir), **SETTINGS)
    from engine.graphs.static_decode import decode_step, padding_inputs
    step = decode_step(llm.engine.model, llm.engine.runner.cache)
    with pytest.raises(RuntimeError, match="freeze_decode_weights"), torch.inference_mode():
        step(**padding_inputs(DecodeShape(2, 1), 0, 0, "cpu"))


def test_context_ladder_and_buckets():
    assert context_ladder(100) == (8, 16, 32, 64, 100)
    assert context_ladder(8) == (8,) and context_ladder(3) == (3,)
    widths = context_ladder(100)
    assert [context_bucket(b, widths) for b in (1, 8, 9, 64, 65, 100, 101)] == [8, 8, 16, 64, 100, 100, None]
    with pytest.raises(ValueError):
        context_ladder(0)


def test_build_inputs_pads_rows_and_tables_with_scratch():
    a = SequenceSlice(1, 4, 3, torch.tensor([7, 2]))          # 5 tokens -> 2 pages of 4
    b = SequenceSlice(1, 0, 1, torch.tensor([5]))             # 1 token -> 1 page
    batch = ForwardBatch([a, b], tiny_cache(block_size=4))
    assert blocks_needed(batch, 4) == 2
    got = build_inputs(torch.tensor([11, 12]), batch, DecodeShape(4, 3), scratch_block=9, scratch_slot=6)
    assert got["input_ids"].tolist() == [11, 12, 0, 0]
    assert got["seq_lens"].tolist() == [5, 1, 1, 1]
    assert got["block_tables"].tolist() == [[7, 2, 9], [5, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert got["kda_slots"].tolist() == [3, 1, 6, 6]
    assert got["fresh"].tolist() == [False, False, True, True]


def tiny_cache(block_size: int) -> HybridCacheTensors:
    from engine.presets import preset_config
    return HybridCacheTensors.allocate(preset_config("tiny").text_config, 10, 7, block_size, torch.float32)
