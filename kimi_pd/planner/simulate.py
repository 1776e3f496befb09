"""An event simulation of a fleet serving a trace: prefill workers, decode workers, or colocated ones.

Prefill workers are FIFO servers with an LRU prefix cache; a request goes to the candidate that
finishes it first (the workers holding its first block, plus two at random). Its state then moves
(`transfer_s`) and joins a decode worker at the next step boundary; the decode worker it joins is the
less loaded of two picked at random. Decode workers batch continuously: a step of B sequences takes
`decode_step(B)`; a sequence beyond `max_batch` waits for a slot. A prompt served on a worker that
also decodes (colocated serving, or the decode-only path for prompts whose uncached part is at most
the threshold) is prefilled in `chunk_tokens` chunks, each riding one decode step and lengthening it:
the interference that disaggregation removes. The first token is the one the prefill computed: the
client sees it when the decode worker admits the request (P/D) or when the prefill ends (on a
decoding worker). Between events a worker's steps are counted, not simulated one by one.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kimi_pd.planner.costs import CostModel
from kimi_pd.planner.workload import Request


class LRU:
    """A worker's prefix cache in blocks: the leading hit, then the prompt's blocks touched."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict[int, None]()

    def hit(self, blocks: Sequence[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, blocks: Sequence[int]) -> None:
        for h in reversed(blocks):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Record:
    """Per-request times, filled as the simulation runs."""

    def __init__(self, reqs: Sequence[Request]) -> None:
        self.reqs = reqs
        self.first = [math.nan] * len(reqs)
        self.finish = [math.nan] * len(reqs)
        self.hit_tokens = 0
        self.decode_only = 0


class DecodingWorker:
    """A worker that decodes (and, colocated or decode-only, also prefills in chunks)."""

    def __init__(self, costs: CostModel, rec: Record) -> None:
        self.costs, self.rec = costs, rec
        self.t, self.steps = 0.0, 0
        self.active: list[tuple[int, int]] = []             # heap of (finish step, request)
        self.waiting: deque[int] = deque()                  # first token out, waiting for a slot
        self.prefills: deque[list[int]] = deque()           # [request, uncached tokens left, prompt tokens]
        self.pending_tokens = 0
        self.cache = LRU(costs.cache_blocks)

    def load(self) -> int:
        return len(self.active) + len(self.waiting) + len(self.prefills)

    def advance(self, t: float) -> None:
        """Run every step that ends by `t`; the worker then sits at the last boundary before `t`."""
        while self.active or self.prefills:
            if self.prefills:
                if self.t + self._iteration_s() > t:
                    return
                self._iterate()
                continue
            step = self.costs.decode_step(len(self.active))
            k = self.active[0][0] - self.steps
            if self.t + k * step <= t:
                self.t, self.steps = self.t + k * step, self.steps + k
                self._settle()
            else:
                k = int((t - self.t) // step)
                self.t, self.steps = self.t + k * step, self.steps + k
                return
        if t != math.inf:
            self.t = max(self.t, t)

    def at_boundary(self, t: float) -> None:
        """Advance to the first step boundary at or after `t` (where new work can join)."""
        self.advance(t)
        if self.t < t and (self.active or self.prefills):
            if self.prefills:
                self._iterate()
            else:
                self.t += self.costs.decode_step(len(self.active))
                self.steps += 1
                self._settle()

    def join(self, t: float, i: int) -> None:
        """A transferred request: its first token goes out when it gets a slot."""
        self.at_boundary(t)
        self.cache.touch(self.rec.reqs[i].blocks)
        self.waiting.append(i)
        self._settle()

    def prefill(self, t: float, i: int, uncached: int) -> None:
        self.at_boundary(t)
        req = self.rec.reqs[i]
        self.cache.touch(req.blocks)
        self.prefills.append([i, max(uncached, 1), req.input_tokens])
        self.pending_tokens += max(uncached, 1)

    def _iteration_s(self) -> float:
        job = self.prefills[0]
        decode = self.costs.decode_step(len(self.active)) if self.active else 0.0
        return decode + self.costs.chunk_s(job[2], min(self.costs.chunk_tokens, job[1]))

    def _iterate(self) -> None:
        self.t += self._iteration_s()
        if self.active:
            self.steps += 1
        job = self.prefills[0]
        chunk = min(self.costs.chunk_tokens, job[1])
        job[1] -= chunk
        self.pending_tokens -= chunk
        if job[1] == 0:
            self.prefills.popleft()
            self.rec.first[job[0]] = self.t
            self.waiting.append(job[0])
        self._settle()

    def _settle(self) -> None:
        """Finish what is done at this boundary, then give free slots to waiting requests."""
        while self.active and self.active[0][0] <= self.steps:
            self.rec.finish[heapq.heappop(self.active)[1]] = self.t
        while self.waiting and len(self.active) < self.costs.max_batch:
            i = self.waiting.popleft()
            if math.isnan(self.rec.first[i]):
                self.rec.first[i] = self.t
            left = self.rec.reqs[i].output_tokens - 1
            if left <= 0:
                self.rec.finish[i] = self.t
            else:
                heapq.heappush(self.active, (self.steps + left, i))


class PrefillPool:
    """FIFO prefill workers with LRU caches; which worker holds which first block, for candidates."""

    def __init__(self, n: int, costs: CostModel, rng: random.Random) -> None:
        self.costs, self.rng = costs, rng
        self.free_at = [0.0] * n
        self.caches = [LRU(costs.cache_blocks) for _ in range(n)]
        self.holders: dict[int, list[int]] = {}

    def serve(self, req: Request, rec: Record) -> float:
        """Place and run `req`'s prefill; returns when its state is ready on the prefill worker."""
        cands = candidates(len(self.free_at), self.holders, req, self.rng)
        best = (math.inf, 0, 0)
        for w in cands:
            hit = min(self.caches[w].hit(req.blocks) * self.costs.block_tokens, req.input_tokens)
            end = max(self.free_at[w], req.arrival) + self.costs.prefill_s(req.input_tokens, req.input_tokens - hit)
            best = min(best, (end, w, hit))
        end, w, hit = best
        self.free_at[w] = end
        self.caches[w].touch(req.blocks)
        remember(self.holders, req, w)
        rec.hit_tokens += hit
        return end


def candidates(n: int, holders: dict[int, list[int]], req: Request, rng: random.Random) -> set[int]:
    """Workers worth scoring for `req`: recent holders of its first block and two picked at random."""
    out = {rng.randrange(n), rng.randrange(n)}
    if req.blocks:
        out.update(holders.get(req.blocks[0], ())[-4:])
    return out


def remember(holders: dict[int, list[int]], req: Request, w: int) -> None:
    if req.blocks:
        seen = holders.setdefault(req.blocks[0], [])
        if w in seen:
            seen.remove(w)
        seen.append(w)


@dataclass(frozen=True)
class Fleet:
    """What is simulated: `prefill` = 0 means colocated (every worker prefills and decodes)."""

    prefill: int
    decode: int
    threshold: int = 0        # decode-only when the uncached tokens are at most this (P/D only)

    @property
    def colocated(self) -> bool:
        return self.prefill == 0


def simulate(reqs: Sequence[Request], fleet: Fleet, costs: CostModel, seed: int = 0) -> dict[str, Any]:
    """Serve `reqs` on `fleet`; the per-request TTFT/TPOT percentiles and totals."""
    if fleet.decode < 1 or fleet.prefill < 0:
        raise ValueError("a fleet needs at least one decoding worker")
    rng = random.Random(seed)
    rec = Record(reqs)
    workers = [DecodingWorker(costs, rec) for _ in range(fleet.decode)]
    pool = PrefillPool(fleet.prefill, costs, rng) if fleet.prefill else None
    holders: dict[int, list[int]] = {}
    events: list[tuple[float, int, int]] = [(r.arrival, 0, i) for i, r in enumerate(reqs)]   # 0 arrive, 1 join
    heapq.heapify(events)
    while events:
        t, kind, i = heapq.heappop(events)
        req = reqs[i]
        if kind == 1:
            a, b = (workers[rng.randrange(fleet.decode)] for _ in range(2))
            a.advance(t)
            b.advance(t)
            (a if a.load() <= b.load() else b).join(t, i)
            continue
        w, uncached = _local_choice(workers, holders, req, costs, rng)
        if pool is None or uncached <= fleet.threshold:
            workers[w].prefill(t, i, uncached)
            remember(holders, req, w)
            rec.hit_tokens += req.input_tokens - uncached
            rec.decode_only += pool is not None
        else:
            ready = pool.serve(req, rec) + costs.transfer_s(req.input_tokens)
            heapq.heappush(events, (ready, 1, i))
    for worker in workers:
        worker.advance(math.inf)
    return summarize(rec, fleet, costs)


def _local_choice(workers: list[DecodingWorker], holders: dict[int, list[int]], req: Request, costs: CostModel,
                  rng: random.Random) -> tuple[int, int]:
    """The decoding worker that would start `req`'s prefill soonest, and its uncached tokens there."""
    best = (math.inf, 0, req.input_tokens)
    for w in candidates(len(workers), holders, req, rng):
        worker = workers[w]
        worker.advance(req.arrival)
        uncached = req.input_tokens - min(worker.cache.hit(req.blocks) * costs.block_tokens, req.input_tokens)
        wait = (worker.pending_tokens + uncached) / costs.chunk_tokens * costs.decode_step(len(worker.active) + 1)
        slots = (len(worker.active) + len(worker.waiting)) / costs.max_batch
        best = min(best, (wait + slots * costs.decode_step(costs.max_batch), w, uncached))
    return best[1], best[2]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(rec: Record, fleet: Fleet, costs: CostModel) -> dict[str, Any]:
    ttft = [f - r.arrival for f, r in zip(rec.first, rec.reqs, strict=True)]
    tpot = [(e - f) / (r.output_tokens - 1) for f, e, r in zip(rec.first, rec.finish, rec.reqs, strict=True)
            if r.output_tokens > 1]
    prompt = sum(r.input_tokens for r in rec.reqs)
    out = {"prefill": fleet.prefill, "decode": fleet.decode, "threshold": fleet.threshold,
           "requests": len(rec.reqs), "hit_ratio": rec.hit_tokens / max(prompt, 1),
           "decode_only_ratio": rec.decode_only / max(len(rec.reqs), 1),
           "makespan_s": max(rec.finish) if rec.reqs else 0.0}
    for name, vals in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q / 100)
    return out
