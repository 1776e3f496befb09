"""Speculative decoding's part of an engine step, behind one object: verify each request's draft block
against the target's rows (rolling back KDA state and cache pages past the accepted tokens), write the
verified tokens' context for the draft model, propose the next blocks, and keep the stats.

The engine asks it three things per step (`verify`, `write_context`, `propose`); without a
`--speculative-config` the engine has no such object and steps plainly. How many tokens each request
drafts (K, 0 = none this step) is `choose`'s: vLLM's per-batch-size schedule when configured, else the
adaptive policy (engine/spec_decode/adaptive.py) over measured step costs, else num_speculative_tokens.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from engine.core.request import Request, RequestStatus
from engine.sampler import SamplingState
from engine.spec_decode.adaptive import AcceptanceTracker, CostCorrection, StepCosts, choose_drafts
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import ContextRows, DraftRequest, DSparkProposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.verify import VerifyResult, verify

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.core.cache_manager import HybridCacheManager
    from engine.core.scheduler import ScheduledSeq


class SpecDecodeStep:
    def __init__(self, spec: SpeculativeConfig, proposer: DSparkProposer, stats: SpecDecodeStats, runner: Any,
                 cache: HybridCacheManager, eos_token_ids: set[int], max_model_len: int) -> None:
        self.spec, self.proposer, self.stats, self.runner, self.cache = spec, proposer, stats, runner, cache
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.tracker, self.correction = AcceptanceTracker(), CostCorrection()
        # the adaptive plan the next step runs: (request ids, batch, speculating, tabled seconds, draft seconds)
        self._planned: tuple[frozenset[str], int, bool, float, float] | None = None
        self._costs = StepCosts.from_dict(spec.adaptive_costs) if spec.adaptive_costs else None
        self._calibrate_after = 0            # step count before which no calibration is tried (no cache room)
        self._steps = 0
        self._off_streak = 0                 # consecutive all-off plans for the same requests (replanning is skipped)
        self._off_for: frozenset[str] = frozenset()
        self._idle_owed = 0                  # fast off steps whose acceptance fades are not applied yet

    def verify(self, s: ScheduledSeq, logits: torch.Tensor) -> VerifyResult:
        """Check `s`'s drafts against its n+1 logit rows; keep the state of the consumed tokens only."""
        req, n = s.req, len(s.draft_token_ids)
        state = SamplingState(req.params, req.prompt_token_ids, req.output_token_ids, req.generator,
                              req.bad_words_token_ids, req.grammar)
        checked = verify(logits, s.draft_token_ids, state, self.eos_token_ids,
                         s.num_computed_before, req.sampling_seed, req.spec_draft_logits)
        self.stats.record_draft(n, checked.num_accepted_drafts)
        self.tracker.record(req.request_id, n, checked.num_accepted_drafts)
        req.spec_token_ids, req.spec_draft_logits = [], None
        consumed = checked.num_consumed
        if consumed < n + 1:
            self.runner.rollback_kda(req.kda_slot, consumed)
        req.num_computed_tokens += consumed
        self.cache.trim(req, req.num_computed_tokens)
        return checked

    def write_context(self, context: ContextRows | None) -> None:
        """Draft context rows of the tokens verified this step (before commit publishes or frees blocks)."""
        if context is not None:
            self.proposer.write_rows(context)

    def propose(self, candidates: list[Request], verify_s: float | None, step_started: float | None = None) -> None:
        """Draft the next block of every request that speculates now; record draft and verify times.

        step_started: when this step's forward began (perf_counter), to compare the step with its plan."""
        if self._reuse_off_plan(candidates):
            self.stats.record_choice(0)
            self.stats.record_times(None, verify_s)
            return
        started = time.perf_counter()
        capped = [(r, k) for r in candidates if (k := self.num_drafts_for(r)) > 0]
        if step_started is not None:
            self._observe(capped, started - step_started)
        reqs = [(r, k) for (r, _), k in zip(capped, self.choose(capped), strict=True) if k > 0]
        drafts = [DraftRequest(r.blocks, r.num_computed_tokens, r.output_token_ids[-1], k,
                               0.0 if r.params.is_greedy else r.params.temperature, r.sampling_seed) for r, k in reqs]
        blocks = self.proposer.propose(drafts) if drafts else []
        for (req, _), block in zip(reqs, blocks, strict=False):
            req.spec_token_ids, req.spec_draft_logits = block.token_ids, block.logits
        draft_s = time.perf_counter() - started
        if self._planned is not None:
            self._planned = (*self._planned[:4], draft_s)
        self.stats.record_times(draft_s if reqs else None, verify_s)

    def _reuse_off_plan(self, candidates: list[Request]) -> bool:
        """The cheap way through a step that keeps an all-off plan (`_keep_off`, with no planned step to
        observe): no plan bookkeeping, and the acceptance fades those steps owe are applied before the
        next plan (`_settle_idle`). At batch 16 the full path cost about 3 % of a tiny-chat step."""
        if self._planned is not None or not self._off_plan_due():
            return False
        if not self._keep_off(frozenset(r.request_id for r in candidates if self.num_drafts_for(r) > 0)):
            return False
        self._idle_owed += 1
        return True

    def _settle_idle(self) -> None:
        """Apply the fades owed by fast off steps to the requests that plan left off, and the global one."""
        if self._idle_owed:
            for rid in self._off_for & self.tracker.per_request.keys():
                self.tracker.idle(rid, self._idle_owed)
            self.tracker.idle_step(self._idle_owed)
            self._idle_owed = 0

    def _observe(self, capped: list[tuple[Request, int]], step_s: float) -> None:
        """Fold the step just run into the cost correction, when it ran the batch that was planned (no
        request joined or left: a prefill in it would not be the planned work)."""
        planned, self._planned = self._planned, None
        costs = self._costs
        if planned is None or costs is None or planned[0] != frozenset(r.request_id for r, _ in capped):
            return
        _, batch, speculating, tabled_s, draft_s = planned
        self.correction.observe(costs, batch, speculating, tabled_s, step_s + draft_s)

    def choose(self, capped: list[tuple[Request, int]]) -> list[int]:
        """K for each (request, most it may draft) that could speculate this step; records the choice."""
        self._settle_idle()
        if not capped:
            return []
        caps = [k for _, k in capped]
        scheduled = self.spec.num_drafts_for_batch(len(capped))
        if scheduled is not None:
            ks = [min(c, scheduled) for c in caps]
        elif not self.spec.adaptive_num_speculative_tokens:
            ks = caps
        elif (costs := self.costs()) is None:
            ks = [0] * len(caps)             # not measured yet (no cache room): plain decoding is never slower
        elif self._still_off(capped):
            ks = [0] * len(caps)
            self._fade(capped, ks)
        else:
            self.tracker.forget({r.request_id for r, _ in capped})
            b = len(capped)
            plan = choose_drafts(costs, [self.tracker.alpha(r.request_id) for r, _ in capped], caps,
                                 spec_scale=self.correction.scale(costs, b, True),
                                 plain_scale=self.correction.scale(costs, b, False))
            ks = list(plan.num_drafts)
            self._planned = (frozenset(r.request_id for r, _ in capped), b, any(ks), plan.seconds, 0.0)
            self._fade(capped, ks)
            self._off_streak = self._off_streak + 1 if not any(ks) else 0
            if self._off_streak == 1:
                self._off_for = frozenset(r.request_id for r, _ in capped)
        self.stats.record_choice(max(ks))
        return ks

    REPLAN_OFF_EVERY = 4

    def _still_off(self, capped: list[tuple[Request, int]]) -> bool:
        if not self._keep_off(frozenset(r.request_id for r, _ in capped)):
            return False
        self._planned = None
        return True

    def _off_plan_due(self) -> bool:
        """An all-off plan stands for REPLAN_OFF_EVERY - 1 more steps without replanning: at a large batch
        the plan costs a measurable share of a small model's step, and acceptance records move little
        while nobody drafts."""
        return bool(self._off_streak) and self._off_streak % self.REPLAN_OFF_EVERY != 0

    def _keep_off(self, could_draft: frozenset[str]) -> bool:
        """Whether this step keeps the all-off plan (counted in the streak): only for the requests it was
        made for; any joining or leaving ends the streak, and the step replans."""
        if not self._off_plan_due():
            return False
        if could_draft != self._off_for:
            self._off_streak = 0
            return False
        self._off_streak += 1
        return True

    def _fade(self, capped: list[tuple[Request, int]], ks: list[int]) -> None:
        """Acceptance records of the requests not drafting fade toward the prior (and the global one when
        nobody drafts), on planned and reused off steps alike, so speculation is probed again as soon."""
        for (r, _), k in zip(capped, ks, strict=True):
            if k == 0:
                self.tracker.idle(r.request_id)
        if not any(ks):
            self.tracker.idle_step()

    def costs(self) -> StepCosts | None:
        """The configured `adaptive_costs`, else measured on this engine at first use. None on a data-parallel
        rank (its forwards are in lock-step with the other ranks', so it cannot run stand-in steps alone)."""
        if self._costs is None and hasattr(self.runner, "dummy"):
            return None
        if self._costs is None:
            self._steps += 1
            if self._steps < self._calibrate_after:
                return None
            from engine.spec_decode.calibrate import NoRoomToCalibrate, measured_costs
            try:
                self._costs = measured_costs(self)
            except NoRoomToCalibrate as exc:    # every cache block in use: decode plainly, try again later
                self._calibrate_after = self._steps + 64
                log.warning("%s; speculation stays off and calibration is retried in 64 steps", exc)
        return self._costs

    def num_drafts_for(self, req: Request) -> int:
        """The most tokens `req` may draft now (0: it does not speculate this step).

        Bounded by its remaining output (a verify step emits up to drafts+1 tokens), the context
        length, and the draft's `max_model_len` (longer sequences decode without speculation)."""
        num_tokens = req.num_tokens
        if not req.draft_context_ready or req.status != RequestStatus.RUNNING \
                or num_tokens != req.num_computed_tokens + 1:
            return 0
        n = self.spec.num_speculative_tokens
        assert n is not None and self.spec.max_model_len is not None      # resolved at engine start
        if num_tokens + n > self.spec.max_model_len:
            return 0
        return max(0, min(n, req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - num_tokens))
