"""Adaptive speculation: the cost model and policy (pure, table-driven), and in the engine greedy output
== plain greedy while K changes between steps, turns off and back on; spec stats stay right."""
from __future__ import annotations

import itertools

import pytest

from engine import SamplingParams
from engine.core.engine import EngineConfig, LLMEngine
from engine.spec_decode.adaptive import (
    AcceptanceTracker,
    CostCorrection,
    StepCosts,
    choose_drafts,
    expected_accepted,
    expected_accepted_measured,
)
from engine.spec_decode.calibrate import grid, lower_envelope, measure
from engine.spec_decode.config import SpecConfigError
from tests.engine.spec_decode.conftest import GREEDY, SETTINGS, make_llm, oracle_drafts, prompt_ids, spec, tokens

PROMPTS = [prompt_ids(9, 1), prompt_ids(23, 2), prompt_ids(4, 3), prompt_ids(15, 4)]


def costs(verify_per_token: float, draft: float, plain: float = 0.010) -> StepCosts:
    """A target step of plain + verify_per_token * (q - 1) * b seconds; a draft step of `draft` seconds."""
    batches, queries = (1, 2, 4, 8, 16), (1, 2, 4, 8)
    target = tuple(tuple(plain + verify_per_token * (q - 1) * b for q in queries) for b in batches)
    return StepCosts(batches, queries, target, (1, 4, 7), tuple((draft, draft, draft) for _ in batches))


CHEAP = costs(0.0002, 0.001)          # verifying is nearly free: speculate
COSTLY = costs(0.005, 0.006)          # every verified token costs half a plain step: never worth it


@pytest.mark.parametrize("table, alpha, batch, want", [
    (CHEAP, 0.8, 1, 7), (CHEAP, 0.8, 16, None), (CHEAP, 0.05, 4, 0),
    (COSTLY, 0.8, 1, 0), (COSTLY, 0.99, 16, 0),
    (costs(0.001, 0.001), 0.6, 1, None), (costs(0.001, 0.001), 0.6, 16, 0),    # None: some K in 1..6
])
def test_choose_drafts_table(table, alpha, batch, want):
    plan = choose_drafts(table, [alpha] * batch, [7] * batch)
    if want is None:
        assert 0 < max(plan.num_drafts) < 7, plan
    else:
        assert plan.num_drafts == (want,) * batch, plan
    assert (plan.tokens_per_s > plan.plain_tokens_per_s) == (max(plan.num_drafts) > 0)


def test_choose_drafts_respects_caps_and_prefers_good_requests():
    plan = choose_drafts(costs(0.001, 0.001), [0.95, 0.2, 0.95], [3, 7, 0])
    assert plan.num_drafts[0] == 3 and plan.num_drafts[2] == 0
    assert plan.num_drafts[1] < plan.num_drafts[0]


def test_choose_drafts_looks_past_a_first_draft_that_does_not_pay():
    """Batch 1 with a draft step's fixed cost: one draft loses to plain, seven win (a real tiny-chat table);
    the scan must not stop after the first losing round."""
    table = StepCosts((1, 2), (1, 2, 4, 8), ((0.0036, 0.0044, 0.0049, 0.0055), (0.0040, 0.0049, 0.0054, 0.0068)),
                      (1, 4, 7), ((0.0012, 0.0013, 0.0014), (0.0013, 0.0014, 0.0015)))
    one = (1.6 / (0.0036 + 0.0044 - 0.0036 + 0.0012))
    assert one < 1.1 / 0.0036                                        # a single draft does not pay here
    plan = choose_drafts(table, [0.6], [7])
    assert plan.num_drafts[0] > 1 and plan.tokens_per_s > 1.1 * plan.plain_tokens_per_s


def test_no_cache_room_to_calibrate_keeps_speculation_off_and_retries(tiny_dir, draft7, monkeypatch):
    """Calibration at first use with every block taken: no crash, K=0 (plain is never slower), retried later."""
    from engine.spec_decode import calibrate
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, adaptive_num_speculative_tokens=True))
    step, calls = llm.engine.speculation, []

    def full(engine):
        calls.append(engine)
        raise calibrate.NoRoomToCalibrate("adaptive speculation: no free cache room to measure step costs")

    monkeypatch.setattr(calibrate, "measured_costs", full)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(make_llm(tiny_dir).generate(PROMPTS[:2], params))
    assert tokens(llm.generate(PROMPTS[:2], params)) == want
    assert len(calls) == 1 and llm.engine.spec_stats.num_drafts == 0        # off, and not retried every step
    assert sum(llm.engine.spec_stats.steps_by_k[1:]) == 0
    monkeypatch.setattr(calibrate, "measured_costs", lambda engine: CHEAP)
    step._calibrate_after = 0
    assert tokens(llm.generate(PROMPTS[:2], params)) == want              # measured now: it speculates
    assert llm.engine.spec_stats.num_drafts > 0
    llm.engine.check_integrity()


def test_reused_off_plans_count_each_step_once(tiny_dir, draft7, monkeypatch):
    """An all-off plan is reused while the same requests run and replanned every REPLAN_OFF_EVERY steps; every
    step, planned or reused, is counted once in steps_by_k."""
    from types import SimpleNamespace

    import engine.spec_decode.step as step_module
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, adaptive_num_speculative_tokens=True,
                                                     adaptive_costs=COSTLY.to_dict()))
    plans = []
    monkeypatch.setattr(step_module, "choose_drafts", lambda *a, **k: plans.append(1) or choose_drafts(*a, **k))
    capped = [(SimpleNamespace(request_id=f"r{i}"), 7) for i in range(4)]
    for _ in range(10):
        assert llm.engine.speculation.choose(capped) == [0, 0, 0, 0]
    assert len(plans) == 3                                     # steps 1, 5 and 9 plan; the rest reuse
    assert llm.engine.spec_stats.steps_by_k[0] == 10 and sum(llm.engine.spec_stats.steps_by_k) == 10


def test_fast_off_steps_equal_full_off_steps(tiny_dir, draft7, monkeypatch):
    """Steps that keep an all-off plan skip the plan bookkeeping (`_reuse_off_plan`) and settle the
    acceptance fades they owe before the next plan: the same outputs, plans, step counts and acceptance
    records as taking the full path every step."""
    import engine.spec_decode.step as step_module
    plans: list[int] = []
    monkeypatch.setattr(step_module, "choose_drafts", lambda *a, **k: plans.append(len(a[1])) or choose_drafts(*a, **k))
    fast_steps: list[bool] = []
    reuse = step_module.SpecDecodeStep._reuse_off_plan
    runs = {}
    for fast in (True, False):
        plans.clear()
        llm = make_llm(tiny_dir, speculative_config=spec(draft7, adaptive_num_speculative_tokens=True,
                                                         adaptive_costs=COSTLY.to_dict()))
        speculation = llm.engine.speculation

        def reuse_or_not(candidates, speculation=speculation, fast=fast) -> bool:
            if not fast:
                return False                                   # the full path every step
            fast_steps.append(reuse(speculation, candidates))
            return fast_steps[-1]
        monkeypatch.setattr(speculation, "_reuse_off_plan", reuse_or_not)
        for accepted in (7, 2, 5):                                 # a record for the off steps to fade
            speculation.tracker.record("earlier", 7, accepted)
        out = tokens(llm.generate(PROMPTS, GREEDY))
        speculation._settle_idle()
        runs[fast] = (out, list(plans), list(llm.engine.spec_stats.steps_by_k), speculation.tracker.global_alpha)
    assert runs[True][:3] == runs[False][:3]
    assert runs[True][3] == pytest.approx(runs[False][3], rel=1e-12) and runs[True][3] != pytest.approx(0.6)
    assert sum(fast_steps) > len(runs[True][1])                # most off steps took the fast path


def test_expected_accepted():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.9, 0) == 0
    assert expected_accepted_measured([0.5, 0.3, 0.2], 2) == pytest.approx(0.8)


def test_costs_interpolate_extrapolate_and_round_trip():
    c = costs(0.001, 0.002)
    assert c.target_s(4, 1) == pytest.approx(0.010)
    assert c.target_s(3, 3) == pytest.approx(0.010 + 0.001 * 2 * 3)
    assert c.target_s(32, 2) > c.target_s(16, 2)                      # past the table: keeps growing
    assert StepCosts.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="batch_sizes"):
        StepCosts.from_dict({**c.to_dict(), "batch_sizes": [4, 2, 1, 8, 16]})
    with pytest.raises(ValueError, match="target"):
        StepCosts.from_dict({**c.to_dict(), "target": [[0.1]]})


def test_lower_envelope_irons_out_a_high_outlier():
    assert lower_envelope([[9.0, 2.0, 3.0], [2.5, 2.6, 4.0]]) == ((2.0, 2.0, 3.0), (2.5, 2.6, 4.0))
    assert grid(16, 7) == ((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 4, 7))
    assert grid(6, 3) == ((1, 2, 4, 6), (1, 2, 4), (1, 2, 3))


def test_tracker_cuts_back_a_poor_request_and_forgives_it():
    t = AcceptanceTracker()
    for _ in range(5):
        t.record("good", 7, 7)
        t.record("bad", 7, 0)
    assert t.alpha("good") > 0.8 > 0.5 > t.alpha("bad")
    low = t.alpha("bad")
    for _ in range(10):
        t.idle("bad")
    assert t.alpha("bad") > low + 0.2
    t.forget({"good"})
    assert set(t.per_request) == {"good"}


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return tokens(make_llm(tiny_dir).generate(PROMPTS, GREEDY))


def test_changing_k_off_and_on_equals_plain(tiny_dir, draft7, plain):
    """A scripted policy: each step a different K per request, including 0 (off) between drafting steps."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7))
    script = itertools.cycle([7, 0, 3, 1, 0, 0, 5, 2, 6, 4])

    def choose(capped):
        ks = [min(cap, next(script)) for _, cap in capped]
        llm.engine.spec_stats.record_choice(max(ks, default=0))
        return ks

    speculation = llm.engine.speculation
    speculation.choose = choose
    verified: list[int] = []
    verify = speculation.verify
    speculation.verify = lambda s, logits: (verified.append(len(s.draft_token_ids)), verify(s, logits))[1]
    oracle_drafts(llm, {tuple(p): p + o for p, o in zip(PROMPTS, plain, strict=True)},
                  wrong_at=lambda step: (step * 3) % 9)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.spec_stats
    assert len(set(verified)) >= 4                              # blocks of several lengths were verified
    drained = stats.drain()                                     # what the vllm:spec_decode_* families read
    assert drained["num_drafts"] == len(verified) == len(drained["acceptance_lengths"])
    assert drained["num_draft_tokens"] == sum(verified)
    assert drained["num_accepted_tokens"] == sum(stats.accepted_per_pos) == sum(drained["acceptance_lengths"]) \
        - len(verified)
    assert all(a >= b for a, b in itertools.pairwise(stats.accepted_per_pos))      # cumulative by position
    assert stats.steps_by_k[0] > 0 and sum(stats.steps_by_k[1:]) > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("table", [CHEAP, COSTLY])
def test_adaptive_with_cost_override_equals_plain(tiny_dir, draft7, plain, table):
    """The real policy (no timing: the costs are given) with the random draft: on, or off throughout."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, adaptive_num_speculative_tokens=True,
                                                     adaptive_costs=table.to_dict()))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.spec_stats
    if table is COSTLY:
        assert stats.num_drafts == 0 and sum(stats.steps_by_k[1:]) == 0 and stats.steps_by_k[0] > 0
    else:
        assert stats.num_drafts > 0 and sum(stats.steps_by_k[1:]) > 0
    llm.engine.check_integrity()


def test_adaptive_turns_off_a_draft_that_is_always_wrong_and_back_on(tiny_dir, draft7, plain):
    """Oracle drafts always wrong for a while: the policy stops drafting; right again later: it resumes."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, adaptive_num_speculative_tokens=True,
                                                     adaptive_costs=costs(0.0005, 0.002).to_dict()))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = tokens(make_llm(tiny_dir).generate(PROMPTS[:1], params))
    oracle_drafts(llm, {tuple(PROMPTS[0]): PROMPTS[0] + want[0]}, wrong_at=lambda step: 0 if step < 3 else None)
    assert tokens(llm.generate(PROMPTS[:1], params)) == want
    stats = llm.engine.spec_stats
    assert stats.steps_by_k[0] > 0                       # turned off after the misses
    assert stats.num_accepted_tokens > 0                 # and on again, accepting
    llm.engine.check_integrity()


def test_vllm_batch_size_schedule(tiny_dir, draft7, plain):
    """vLLM's num_speculative_tokens_per_batch_size: K=3 alone, off from 2 requests up."""
    llm = make_llm(tiny_dir, speculative_config=spec(draft7, num_speculative_tokens_per_batch_size=[[1, 1, 3],
                                                                                                   [2, 8, 0]]))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.spec_stats
    assert stats.steps_by_k[0] > 0 and set(stats.steps_by_k[4:]) == {0}
    alone = make_llm(tiny_dir, speculative_config=spec(draft7, num_speculative_tokens_per_batch_size=[[1, 1, 3]]))
    assert tokens(alone.generate(PROMPTS[:1], GREEDY)) == plain[:1]
    s = alone.engine.spec_stats                  # K=3 throughout (the last block is cut by max_tokens)
    assert s.steps_by_k[3] > 0 and set(s.steps_by_k[4:]) == {0} and s.num_draft_tokens <= 3 * s.num_drafts


@pytest.mark.parametrize("field, value, message", [
    ("num_speculative_tokens_per_batch_size", [[2, 1, 3]], "per_batch_size"),
    ("num_speculative_tokens_per_batch_size", [[1, 4, 9]], "above num_speculative_tokens"),
    ("num_speculative_tokens_per_batch_size", "1-4:3", "per_batch_size"),
    ("adaptive_num_speculative_tokens", "yes", "boolean"),
    ("adaptive_costs", {"batch_sizes": [1]}, "adaptive_costs"),
])
def test_bad_adaptive_settings_fail_at_startup(tiny_dir, draft7, field, value, message):
    with pytest.raises(SpecConfigError, match=message):
        LLMEngine(EngineConfig(model=str(tiny_dir), speculative_config=spec(draft7, **{field: value}), **SETTINGS))


def test_calibration_measures_and_leaves_nothing_behind(tiny_dir, draft7):
    llm = make_llm(tiny_dir, max_num_seqs=2, speculative_config=spec(draft7, num_speculative_tokens=3))
    engine = llm.engine
    table = measure(engine.speculation, 3, reps=1)
    table.validate()
    assert table.batch_sizes == (1, 2) and table.query_lens == (1, 2, 4) and table.draft_lens == (1, 2, 3)
    assert engine.spec_stats.num_drafts == 0 and not engine.cache.drain_events()
    assert engine.cache.pool.num_free == engine.cache.pool.usable_blocks
    assert engine.cache.slots.num_free_working == engine.cache_config.num_working_slots
    engine.check_integrity()


def test_cost_correction_moves_the_choice_to_what_the_steps_showed():
    """Tabled costs say speculate; observed speculating steps twice as slow as tabled: off."""
    table, alphas, caps = costs(0.0005, 0.002), [0.6] * 4, [7] * 4
    assert max(choose_drafts(table, alphas, caps).num_drafts) > 0
    fix = CostCorrection(weight=0.5)
    for _ in range(6):
        fix.observe(table, 4, True, 0.02, 0.04)
        fix.observe(table, 3, False, 0.01, 0.009)
    assert fix.scale(table, 4, True) == pytest.approx(2.0, rel=0.05) and fix.scale(table, 16, True) == 1.0
    plan = choose_drafts(table, alphas, caps, spec_scale=fix.scale(table, 4, True),
                         plain_scale=fix.scale(table, 4, False))
    assert plan.num_drafts == (0, 0, 0, 0)


def test_plain_steps_slower_than_tabled_do_not_make_speculation_look_cheaper():
    """Plain steps running 1.4x their tabled time (a busier host, longer contexts) with no speculating step
    observed: both kinds are scaled alike, so a batch the table keeps off stays off."""
    table, alphas, caps = costs(0.001, 0.002), [0.75] * 16, [7] * 16
    assert max(choose_drafts(table, alphas, caps).num_drafts) == 0
    fix = CostCorrection()
    for _ in range(30):
        fix.observe(table, 16, False, 0.010, 0.014)
    assert fix.scale(table, 16, True) == pytest.approx(fix.scale(table, 16, False), rel=0.01) \
        == pytest.approx(1.4, rel=0.05)
    plan = choose_drafts(table, alphas, caps, spec_scale=fix.scale(table, 16, True),
                         plain_scale=fix.scale(table, 16, False))
    assert plan.num_drafts == (0,) * 16
    # and a host that slows every step while a batch speculates does not lock speculation out afterwards
    fix = CostCorrection()
    for _ in range(30):
        fix.observe(table, 1, True, 0.010, 0.020)
    assert fix.scale(table, 1, True) == pytest.approx(2.0, rel=0.05)
    for _ in range(40):
        fix.observe(table, 1, False, 0.010, 0.020)
    assert fix.scale(table, 1, True) == pytest.approx(fix.scale(table, 1, False), rel=0.15)


def test_queued_context_rows_land_as_immediate_writes_would(tiny_dir, draft7):
    """Context writes are queued while nobody drafts; flushed in order, a block written for one request
    and then reused by another holds the second one's rows, as with immediate writes."""
    import torch
    proposer = make_llm(tiny_dir, speculative_config=spec(draft7)).engine.proposer
    width = proposer.cfg.target_hidden_size * proposer.cfg.num_target_layers
    gen = torch.Generator().manual_seed(0)               # random rows, the same every run
    first, second = torch.randn(3, width, generator=gen), torch.randn(3, width, generator=gen)
    proposer.write_context([([5], 0, first)])
    proposer.write_context([([5], 0, second)])                   # block 5 reused: same slots, later rows
    queued = proposer.export_rows([5], 3)                        # export flushes first
    proposer.write_context([([5], 0, second)])
    proposer.flush()
    again = proposer.export_rows([5], 3)
    fresh = make_llm(tiny_dir, speculative_config=spec(draft7)).engine.proposer
    for rows in (first, second):                                 # immediate writes, one after the other
        fresh.write_context([([5], 0, rows)])
        fresh.flush()
    immediate = fresh.export_rows([5], 3)
    for j in queued:                                             # (batched GEMMs round differently: close)
        torch.testing.assert_close(queued[j], again[j], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(queued[j], immediate[j], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(queued[0], proposer.model.context_kv(first, torch.arange(3))[0].to(queued[0].dtype))


def test_step_context_rows_keep_the_features_tensor_when_every_row_is_kept():
    """A decode step's kept rows are all of the forward's features, in order: queued as that tensor
    (no per-request slices or copy); a verify step keeps some rows of each request: those, in order.
    Slots follow each request's block table (block_size 4 here)."""
    import torch

    from engine.spec_decode.proposer import ContextRows
    features = torch.arange(12.0).view(6, 2)
    whole = ContextRows.of_step([([7], 2, 0, 1), ([3, 9], 5, 1, 1), ([1], 0, 2, 4)], features, 4)
    assert whole.features is features
    assert whole.slots == [7 * 4 + 2, 9 * 4 + 1, 4, 5, 6, 7] and whole.positions == [2, 5, 0, 1, 2, 3]
    verified = ContextRows.of_step([([2, 8], 3, 0, 2), ([6], 1, 3, 1)], features, 4)  # rows 0-1 and 3 kept of 6
    assert torch.equal(verified.features, features[[0, 1, 3]])
    assert verified.slots == [2 * 4 + 3, 8 * 4 + 0, 6 * 4 + 1] and verified.positions == [3, 4, 1]
    items = ContextRows.of([([2, 8], 3, features[0:2]), ([5], 0, features[:0]), ([6], 1, features[3:4])], 4)
    assert items is not None and torch.equal(items.features, verified.features)       # the per-request form
    assert (items.slots, items.positions) == (verified.slots, verified.positions)
    assert ContextRows.of([([5], 0, features[:0])], 4) is None
