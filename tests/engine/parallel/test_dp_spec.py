"""DSpark on a data-parallel engine: each DP rank drafts for its own batch on its own ranks, and the
lock-step holds (one target forward or dummy step per rank per step: the draft has no MoE layer).
Speculative greedy on DP2 x TP1 (EP2) and DP2 x TP2 (EP4) equals plain TP=1 greedy, with requests on
both ranks at once and rank 1 idle (dummy steps) while rank 0's long request finishes; P/D between
DP2 and TP 1 carries the draft's context rows from and into either DP rank."""
from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.core.engine import EngineConfig
from engine.parallel.launch import config_payload
from engine.presets import shipped_checkpoint
from engine.spec_decode.config import SpeculativeConfig
from tests.engine.spec_decode.test_tp_spec import prompts  # noqa: F401 - the held-out task prompts fixture

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(dtype="float64", max_num_seqs=4, max_num_batched_tokens=512, cache_memory_bytes=8 << 20)


def params(n: int) -> list[SamplingParams]:
    """Request 0 (DP rank 0) decodes longest; the others stop early, so rank 1 idles part of the time."""
    return [SamplingParams(temperature=0.0, max_tokens=32 if i == 0 else 6, ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def plain(prompts):  # noqa: F811 - pytest injects the imported fixture
    with LLM(str(shipped_checkpoint("tiny-chat")), **SETTINGS) as llm:
        return [o.output.token_ids for o in llm.generate(prompts, params(len(prompts)))]


@pytest.mark.parametrize("draft,tp", [("tiny-chat-dspark", 1), ("tiny-chat-dspark-gqa", 1), ("tiny-chat-dspark", 2)],
                         ids=["dp2-tp1-mla", "dp2-tp1-gqa", "dp2-tp2-mla"])
def test_speculative_dp_equals_plain_tp1(prompts, plain, draft, tp):  # noqa: F811
    spec: dict | SpeculativeConfig | None = {"method": "dspark", "model": draft, "draft_tensor_parallel_size": tp}
    if draft.endswith("gqa") or tp > 1:                    # parsed, as the worker passes it to the engine
        spec = SpeculativeConfig.parse(spec)
    with LLM(str(shipped_checkpoint("tiny-chat")), data_parallel_size=2, tensor_parallel_size=tp,
             enable_expert_parallel=True, speculative_config=spec, **SETTINGS) as llm:
        got = [o.output.token_ids for o in llm.generate(prompts, params(len(prompts)))]
        engine = llm.engine
        placed, steps = list(engine.placed), engine.step_counts()
        stats = [(engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens), engine.loads[1]["spec"]]
        engine.check_integrity()                            # every DP rank's cache and requests
    assert placed == [2, 2], placed                        # concurrent requests on both DP ranks
    (fwd0, dummy0), (fwd1, dummy1) = steps
    assert fwd0 + dummy0 == fwd1 + dummy1, steps           # lock-step with speculation: one forward per step
    assert dummy1 > 0 and dummy0 == 0, steps                # rank 1 idles while rank 0's long request finishes
    assert all(drafts > 0 and accepted > 0 for drafts, accepted in stats), stats      # both ranks speculate
    assert got == plain


def test_pd_between_dp2_and_tp1_carries_the_draft_rows(prompts, plain):  # noqa: F811
    """A DP2 prefill's state (with the draft's context rows, from either DP rank) imported by a TP 1 decode
    engine, and TP 1's imported by DP2 (into either rank): the plain greedy tokens, each time."""
    from tests.engine.spec_decode.test_pd_spec import pd_generate
    spec = {"method": "dspark", "model": "tiny-chat-dspark"}
    model = str(shipped_checkpoint("tiny-chat"))
    one = LLM(model, speculative_config=spec, **SETTINGS)
    with LLM(model, data_parallel_size=2, enable_expert_parallel=True, speculative_config=spec, **SETTINGS) as dp:
        for i, (prefill, decode) in enumerate([(dp, one), (dp, one), (one, dp), (one, dp)]):
            p = params(len(prompts))[i]
            state, got = pd_generate(prefill, decode, prompts[i], p)
            assert got == plain[i], i
            assert state.draft and all(t.shape[0] == len(prompts[i]) for t in state.draft.values())
        assert dp.engine.placed == [2, 2]                   # each direction used both DP ranks


def test_rank_processes_get_the_parsed_speculative_config_back():
    """The config a rank process reads back (JSON) holds the worker's parsed --speculative-config as vLLM's
    fields, unknown ones included, and parses to the same config."""
    spec = SpeculativeConfig.parse({"method": "dspark", "model": "tiny-chat-dspark", "num_speculative_tokens": 5,
                                    "parallel_drafting": True})
    config = EngineConfig(str(shipped_checkpoint("tiny-chat")), data_parallel_size=2, speculative_config=spec)
    back = EngineConfig(**json.loads(config_payload(config)))
    assert SpeculativeConfig.parse(back.speculative_config) == spec
