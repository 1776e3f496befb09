"""Continuous batching with chunked prefill under a token budget. Owns no tensors.

Every request has `num_computed_tokens` and `num_tokens`; each step gives it
`min(num_tokens - num_computed_tokens, remaining budget)` new tokens. A fresh prompt, a prefill chunk,
a prefix-cache hit (computed jumps to the hit), an imported prefill (computed = prompt length) and
a decode step are all that one rule. A fresh prompt waits while a running request prefills its first
block (`waits_for_shared_prefill`), so the blocks they share are computed once and then hit. When
pages run out, the most recently admitted running request is preempted (its pages freed, recomputed
later from its tokens: prompt + output so far).

Under the `priority` policy (vLLM's `--scheduling-policy priority`) the waiting queue is ordered by
(priority, arrival), lower first, preempted requests included, and the victim of a preemption is the
running request with the highest (priority, arrival) instead of the latest admitted; a victim already
given tokens in this step gives them back. Only order and latency change: each request's tokens do not.

Fairness between requests: the sequences of one request's fan-out (`n`, `best_of`, a list of prompts:
one `group`) hold at most `request_share` of `max_num_seqs` while another group waits. Admission takes
the waiting requests of groups under their share first (under `priority`: first within each priority),
and, under `fcfs`, when every slot is taken the newest sequence of a group over its share is preempted
for them; with nobody else waiting, one group may fill the batch (`fair_order`, `fair_victim`).
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from engine.core.cache_manager import HybridCacheManager, PrefixHit
from engine.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "fcfs"                        # fcfs | priority
    request_share: float = 0.5          # of max_num_seqs, per group while another group waits (1.0: off)

    @property
    def max_group_seqs(self) -> int | None:
        """Sequences one group holds while another waits; None: no limit (first come, first served)."""
        return None if self.request_share >= 1 else max(1, math.ceil(self.request_share * self.max_num_seqs))


SCHEDULING_POLICIES = ("fcfs", "priority")


def _rank(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


@dataclass
class ScheduledSeq:
    req: Request
    num_new_tokens: int
    num_computed_before: int
    snapshots: tuple[tuple[int, int], ...] = ()
    resume_from_slot: int | None = None         # copy this KDA snapshot into the working slot first
    import_state: bool = False                  # write req.imported into the cache first
    draft_token_ids: tuple[int, ...] = ()       # speculative: the new tokens are [last, *drafts]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so its last logits pick the next one."""
        return self.num_computed_before + self.num_new_tokens - len(self.draft_token_ids) == self.req.num_tokens

    @property
    def verifies(self) -> bool:
        return bool(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: HybridCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, req, key=_rank)
        else:
            self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._make_fair_room(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = tuple(req.spec_token_ids)
            # drafts ride along only when they fit without preempting anyone; else a plain decode step
            if not (drafts and n == 1 and budget >= 1 + len(drafts) and self.cache.allocate(req, 1 + len(drafts))):
                drafts = ()
                req.spec_token_ids = []
                if not self._make_room(req, n, out):
                    break                               # req itself was preempted
                if out.preempted and self.config.policy == "priority":
                    budget += self._unschedule(out)     # victims scheduled earlier in this step
                    i = self.running.index(req)
            n += len(drafts)
            out.seqs.append(ScheduledSeq(req, n, req.num_computed_tokens,
                                         self.cache.plan_snapshots(req, req.num_computed_tokens, n - len(drafts)),
                                         draft_token_ids=drafts))
            budget -= n
            i += 1
        return budget

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.cache.allocate(req, n):
            victim = max(self.running, key=_rank) if self.config.policy == "priority" else self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req)
        req.num_computed_tokens = 0
        req.num_published_blocks = 0
        req.snapshot_upto_blocks = 0
        req.num_preemptions += 1
        req.spec_token_ids = []
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        if self.config.policy == "priority":
            bisect.insort(self.waiting, req, key=_rank)
        else:
            self.waiting.appendleft(req)

    @staticmethod
    def _unschedule(out: SchedulerOutput) -> int:
        """Drop this step's seqs of preempted requests; returns the tokens they had been given."""
        gone = set(map(id, out.preempted))
        dropped = [s for s in out.seqs if id(s.req) in gone]
        out.seqs = [s for s in out.seqs if id(s.req) not in gone]
        return sum(s.num_new_tokens for s in dropped)

    def _make_fair_room(self, out: SchedulerOutput) -> None:
        """Every slot taken and a group under its share waiting: preempt one sequence of a group over it."""
        cap = self.config.max_group_seqs
        if cap is None or self.config.policy != "fcfs" or len(self.running) < self.config.max_num_seqs \
                or not self.waiting:
            return                                      # under `priority`, priorities decide who is preempted
        victim = fair_victim(self.waiting, self.running, cap)
        if victim is not None:
            self._preempt(victim)
            out.preempted.append(victim)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if self.config.max_group_seqs is not None:
            fair = fair_order(self.waiting, self.running, self.config.max_group_seqs)
            if fair is not self.waiting and self.config.policy == "priority":   # by priority, then the share
                fair = deque(sorted(fair, key=lambda r: r.priority))
            self.waiting = fair
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.cache.config.enable_prefix_caching and waits_for_shared_prefill(req, self.running):
                deferred.append(self.waiting.popleft())
                continue
            imported = req.imported is not None and req.num_computed_tokens == 0
            if imported:
                req.num_computed_tokens = req.num_prompt_tokens
            hit = self.cache.prefix_hit(req) if req.num_computed_tokens == 0 else PrefixHit.none()
            start = hit.num_tokens or req.num_computed_tokens
            n = min(req.num_tokens - start, budget)
            if not self.cache.allocate(req, n, hit):
                if imported:
                    req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.seqs.append(ScheduledSeq(req, n, start, self.cache.plan_snapshots(req, start, n),
                                         resume_from_slot=req.resume_snapshot_slot, import_state=imported))
            req.resume_snapshot_slot = None
            budget -= n
        self.waiting.extendleft(reversed(deferred))      # back at the head, in their order

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished, held for export or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)


def waits_for_shared_prefill(req: Request, running: list[Request]) -> bool:
    """A fresh prompt whose first block a running request is still prefilling waits for it: once
    that prefill is committed, this one starts from the prefix cache, so n sequences of one prompt
    (and identical prompts sent together) compute their shared blocks once. The hashes carry the
    cache salt, so only requests allowed to share a cache wait for each other."""
    if req.num_computed_tokens or req.imported is not None or req.wants_prompt_logprobs or not req.block_hashes:
        return False
    first = req.block_hashes[0]
    return any(r.block_hashes[:1] == [first] and r.num_computed_tokens < r.num_prompt_tokens and r.imported is None
               for r in running)


def _group_counts(running: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in running:
        counts[r.group_key] = counts.get(r.group_key, 0) + 1
    return counts


def fair_order(waiting: deque[Request], running: list[Request], cap: int) -> deque[Request]:
    """The waiting queue with, first, the requests that keep their group within `cap` sequences (counting
    those running and those ahead of them), then the rest; each part in its own order."""
    counts = _group_counts(running)
    within: deque[Request] = deque()
    beyond: list[Request] = []
    for req in waiting:
        n = counts.get(req.group_key, 0)
        counts[req.group_key] = n + 1
        (within if n < cap else beyond).append(req)
    if not beyond:
        return waiting
    within.extend(beyond)
    return within


def fair_victim(waiting: deque[Request], running: list[Request], cap: int) -> Request | None:
    """The most recently admitted sequence of the group most over `cap`, when a request whose group is
    under `cap` waits; else None (a group within its share is never preempted for another)."""
    counts = _group_counts(running)
    if all(counts.get(req.group_key, 0) >= cap for req in waiting):
        return None
    over = max(counts, key=lambda g: counts[g])
    if counts[over] <= cap:
        return None
    return next(r for r in reversed(running) if r.group_key == over)
