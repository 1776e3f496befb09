"""Data-parallel engines (DP ranks as real processes over gloo on 127.0.0.1) against the TP=1 engine.

Each DP rank has its own scheduler and cache; the routed experts spread over all DP x TP ranks. The
prompts are placed on both DP ranks and run concurrently; one request decodes longer, so the other
rank runs dummy steps while it finishes. fp64: the same greedy tokens and every generated token's
top-5 logprobs within 1e-10 of TP=1, with whole experts per rank (EP 2, EP 4) and without expert
parallelism (every expert split by its intermediate dim over the DP ranks).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(240)

SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2)
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(1, 9), (2, 23), (3, 5)]]
PROMPTS.append(PROMPTS[1][:16] + [5, 6, 7])
# the first request (DP rank 0) decodes longest: rank 1 runs dummy steps meanwhile
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10 if i == 0 else 4, ignore_eos=True, logprobs=5)
          for i in range(len(PROMPTS))]


def run(model_dir, **settings):
    """Every request's (tokens, per-token top-5 logprobs), and the DP front's per-rank counts."""
    with LLM(str(model_dir), **{**SETTINGS, **settings}) as llm:
        outputs = llm.generate(PROMPTS, PARAMS)
        engine = llm.engine
        counts = (list(engine.placed), engine.step_counts()) if hasattr(engine, "placed") else None
        procs = list(engine.tp.procs) if engine.tp is not None else []
    assert all(p.poll() is not None for p in procs), "a rank outlived its engine"
    return [(o.output.token_ids, o.output.top_logprobs) for o in outputs], counts


@pytest.fixture(scope="module")
def reference_fp64(tiny_dir):
    return run(tiny_dir, dtype="float64")[0]


def _worst(a, b) -> float:
    """Largest difference between two requests' top logprobs (same token ids asserted)."""
    worst = 0.0
    for top_a, top_b in zip(a, b, strict=True):
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        worst = max(worst, max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b, strict=True)))
    return worst


@pytest.mark.parametrize("tp,ep", [(1, True), (2, True), (1, False)],
                         ids=["dp2-tp1-ep2", "dp2-tp2-ep4", "dp2-tp1-experts-split"])
def test_fp64_matches_tp1(tiny_dir, reference_fp64, tp, ep):
    got, (placed, steps) = run(tiny_dir, dtype="float64", data_parallel_size=2, tensor_parallel_size=tp,
                               enable_expert_parallel=ep)
    assert placed == [2, 2], placed                     # concurrent requests on both DP ranks
    (fwd0, dummy0), (fwd1, dummy1) = steps
    assert fwd0 + dummy0 == fwd1 + dummy1               # lock-step: one forward or dummy per rank per step
    assert dummy1 > 0 and dummy0 == 0, steps             # rank 1 idles while rank 0's long request finishes
    for (tokens, tops), (ref_tokens, ref_tops) in zip(got, reference_fp64, strict=True):
        assert tokens == ref_tokens
        assert _worst(tops, ref_tops) < 1e-10


def test_prefix_places_on_the_rank_holding_it(tiny_dir):
    """A second request sharing a cached prefix goes to the DP rank whose cache holds it, even when
    that rank is the busier one; a different prompt goes to the idle rank."""
    with LLM(str(tiny_dir), data_parallel_size=2, enable_expert_parallel=True, **SETTINGS) as llm:
        engine = llm.engine
        first = PROMPTS[1]
        llm.generate([PROMPTS[0], first], SamplingParams(temperature=0.0, max_tokens=2))
        assert engine.placed == [1, 1]
        busy = engine.add_request("busy", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3))
        assert engine.placement[busy] == 0
        assert engine.pick_rank(first[:16] + [9, 9, 9], SamplingParams()) == 1     # prefix on rank 1
        assert engine.pick_rank([7] * 12, SamplingParams()) == 1                    # less loaded
        while engine.has_unfinished():
            engine.step()


def test_bad_layouts_are_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(ValueError, match="expert parallelism over 3 ranks"):
        LLM(str(tiny_dir), data_parallel_size=3, enable_expert_parallel=True, **SETTINGS)
    with pytest.raises(ValueError, match="exceeds --data-parallel-size"):
        LLM(str(tiny_dir), data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1, **SETTINGS)
    with pytest.raises(ValueError, match="expected 'k3_dspark'"):          # DSpark runs with DP (test_dp_spec.py),
        LLM(str(tiny_dir), data_parallel_size=2, enable_expert_parallel=True,    # but not a target as its draft
            speculative_config={"method": "dspark", "model": str(tiny_dir)}, **SETTINGS)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        LLM(str(tiny_dir), data_parallel_size=2, enable_expert_parallel=True,
            speculative_config={"method": "dspark", "model": "tiny-chat-dspark", "draft_tensor_parallel_size": 2},
            **SETTINGS)
