"""Speculative decoding's part of an engine step, behind one object: verify each request's draft block
against the target's rows (rolling back KDA state and cache pages past the accepted tokens), write the
verified tokens' context for the draft model, propose the next blocks, and keep the stats.

The engine asks it three things per step (`verify`, `write_context`, `propose`); without a
`--speculative-config` the engine has no such object and steps plainly.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from engine.core.request import Request, RequestStatus
from engine.sampler import SamplingState
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import DraftRequest, DSparkProposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.verify import VerifyResult, verify

if TYPE_CHECKING:
    from engine.core.cache_manager import HybridCacheManager
    from engine.core.scheduler import ScheduledSeq


class SpecDecodeStep:
    def __init__(self, spec: SpeculativeConfig, proposer: DSparkProposer, stats: SpecDecodeStats, runner: Any,
                 cache: HybridCacheManager, eos_token_ids: set[int], max_model_len: int) -> None:
        self.spec, self.proposer, self.stats, self.runner, self.cache = spec, proposer, stats, runner, cache
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def verify(self, s: ScheduledSeq, logits: torch.Tensor) -> VerifyResult:
        """Check `s`'s drafts against its n+1 logit rows; keep the state of the consumed tokens only."""
        req, n = s.req, len(s.draft_token_ids)
        state = SamplingState(req.params, req.prompt_token_ids, req.output_token_ids, req.generator,
                              req.bad_words_token_ids, req.grammar)
        checked = verify(logits, s.draft_token_ids, state, self.eos_token_ids,
                         s.num_computed_before, req.sampling_seed, req.spec_draft_logits)
        self.stats.record_draft(n, checked.num_accepted_drafts)
        req.spec_token_ids, req.spec_draft_logits = [], None
        consumed = checked.num_consumed
        if consumed < n + 1:
            self.runner.rollback_kda(req.kda_slot, consumed)
        req.num_computed_tokens += consumed
        self.cache.trim(req, req.num_computed_tokens)
        return checked

    def write_context(self, context: list[tuple[list[int], int, torch.Tensor]]) -> None:
        """Draft context rows of the tokens verified this step (before commit publishes or frees blocks)."""
        self.proposer.write_context(context)

    def propose(self, candidates: list[Request], verify_s: float | None) -> None:
        """Draft the next block of every request that speculates now; record draft and verify times."""
        started = time.perf_counter()
        reqs = [(r, self.num_drafts_for(r)) for r in candidates]
        reqs = [(r, k) for r, k in reqs if k > 0]
        blocks = self.proposer.propose([DraftRequest(r.blocks, r.num_computed_tokens, r.output_token_ids[-1], k,
                                                     0.0 if r.params.is_greedy else r.params.temperature,
                                                     r.sampling_seed) for r, k in reqs])
        for (req, _), block in zip(reqs, blocks, strict=False):
            req.spec_token_ids, req.spec_draft_logits = block.token_ids, block.logits
        self.stats.record_times(time.perf_counter() - started if reqs else None, verify_s)

    def num_drafts_for(self, req: Request) -> int:
        """How many tokens to draft for `req` now (0: it does not speculate this step).

        Bounded by its remaining output (a verify step emits up to drafts+1 tokens), the context
        length, and the draft's `max_model_len` (longer sequences decode without speculation)."""
        if not req.draft_context_ready or req.status != RequestStatus.RUNNING \
                or req.num_tokens != req.num_computed_tokens + 1:
            return 0
        n = self.spec.num_speculative_tokens
        assert n is not None and self.spec.max_model_len is not None      # resolved at engine start
        if req.num_tokens + n > self.spec.max_model_len:
            return 0
        return max(0, min(n, req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens))
