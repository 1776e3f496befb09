"""TP=2 and TP=2+EP engines (two real processes over gloo on 127.0.0.1) against the TP=1 engine.

fp64: every step's logits within 1e-10; fp32 and W4A8: the same greedy tokens. Each engine is closed
in a `with` block, so its follower process is stopped also when an assertion fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.core.helpers import record_step_logits

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2)
# Prompts crossing pages, KDA chunks and the chunked-prefill budget; one shares a prefix (cache hit).
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(1, 9), (2, 23), (3, 5)]]
PROMPTS.append(PROMPTS[1][:16] + [5, 6, 7])


def run(model_dir, **settings) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and every step's logits, through the whole engine."""
    with LLM(str(model_dir), **{**SETTINGS, **settings}) as llm:
        runner = llm.engine.runner
        logits = record_step_logits(runner)
        outputs = llm.generate(PROMPTS, GREEDY)
        llm.engine.check_integrity()
        if llm.engine.tp is not None:
            procs = llm.engine.tp.procs
    if settings.get("tensor_parallel_size", 1) > 1:
        assert all(p.poll() is not None for p in procs), "a follower rank outlived its engine"
    return [o.output.token_ids for o in outputs], logits


@pytest.fixture(scope="module")
def reference_fp64(tiny_dir):
    return run(tiny_dir, dtype="float64")


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_fp64_logits_match_tp1(tiny_dir, reference_fp64, ep):
    tokens, logits = run(tiny_dir, dtype="float64", tensor_parallel_size=2, enable_expert_parallel=ep)
    ref_tokens, ref_logits = reference_fp64
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=False))
    assert worst < 1e-10, worst


@pytest.fixture(scope="module")
def reference_fp32():
    cache: dict = {}
    return lambda model_dir: cache.setdefault(str(model_dir), run(model_dir))


@pytest.mark.parametrize("checkpoint,ep", [("tiny_dir", True), ("tiny_w4a8_dir", False), ("tiny_w4a8_dir", True)],
                         ids=["fp32-tp2-ep", "w4a8-tp2", "w4a8-tp2-ep"])
def test_greedy_tokens_match_tp1(request, reference_fp32, checkpoint, ep):
    """W4A8 under TP shards the packed int4/int8 weights (no dequantisation); under EP experts stay whole."""
    model_dir = request.getfixturevalue(checkpoint)
    ref_tokens, ref_logits = reference_fp32(model_dir)
    tokens, logits = run(model_dir, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=False))
    assert worst < 1e-4, worst       # fp32 rounding of the re-ordered sums only


def test_indivisible_layout_is_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(str(tiny_dir), tensor_parallel_size=3, **SETTINGS)


def test_speculative_config_with_tp_is_checked_before_any_process_starts(tiny_dir, monkeypatch):
    """DSpark runs at TP > 1 now (tests/engine/spec_decode/test_tp_spec.py); what cannot run still stops
    start-up, before a follower rank is spawned: a directory that is no draft, a draft TP other than 1 or N."""
    import engine.parallel.launch as launch
    monkeypatch.setattr(launch, "spawn_followers", lambda *a: pytest.fail("a follower started"))
    with pytest.raises(ValueError, match="model_type: expected 'k3_dspark'"):
        LLM(str(tiny_dir), tensor_parallel_size=2, speculative_config={"method": "dspark", "model": str(tiny_dir)},
            **SETTINGS)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=3 cannot be other than 1"):
        LLM(str(tiny_dir), tensor_parallel_size=2, speculative_config={
            "method": "dspark", "model": str(tiny_dir), "draft_tensor_parallel_size": 3}, **SETTINGS)
