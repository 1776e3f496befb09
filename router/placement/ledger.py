"""Per-worker ledger of prefill work this router has sent and not yet seen answered.

Requests differ ~100x in prefill work, so a count of requests is a poor queue signal: a worker that
holds a hot prefix can build a long queue of big prompts while its count looks ordinary. The
ledger instead keeps, per worker, the uncached tokens of every open leg (added when the leg is
sent, settled when its answer - or a stream's first chunk - arrives) and a calibrated prefill
speed, so placement can compare expected completion times:

    backlog_s(w) = (sum of open legs' tokens - progress on the oldest leg) / tokens_per_s(w)

The ledger also keeps the uncached prefill seconds of the last `tail_window` legs it opened, so placement can
ask how long the fleet's long prefills take (`tail_prefill_s`, a high quantile): a bound on waiting that
follows the traffic and the hardware instead of a fixed number of seconds.

Speed is learnt from the answers themselves: each settled leg was worked on from the later of its
send time and the previous settle on that worker, so tokens / busy time, averaged with a decay
(token-weighted, so fixed per-request overheads of small legs barely move it), tracks what the
worker really does, whatever the starting guess. Time comes from an injected clock (replays).
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass(frozen=True)
class LedgerConfig:
    """`tokens_per_s`: the starting guess for a worker's prefill speed (per worker overrides in
    `worker_tokens_per_s`); `decay`: weight kept by the old estimate per settled leg's share of
    `decay_tokens` (0.5 ** (tokens / decay_tokens)); `calibrate=False` keeps the given speeds."""

    tokens_per_s: float = 20000.0
    worker_tokens_per_s: tuple[tuple[str, float], ...] = ()
    decay_tokens: float = 200000.0
    calibrate: bool = True
    # a leg below this many uncached tokens is timed mostly by fixed costs (HTTP, scheduling, one
    # forward's launch: a few ms on an accelerator, the same as 512 tokens of prefill), so its wall
    # time says nothing about per-token speed; 64 let short legs timed on a starved host price an
    # idle vLLM worker 6x slower than its twin and send prefixes away from their holder
    min_leg_tokens: int = 512
    # the recent legs behind `tail_prefill_s`: how many, which quantile, and how many before it answers
    tail_window: int = 2000
    tail_quantile: float = 0.99
    tail_min_legs: int = 50

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0 or self.decay_tokens <= 0 or any(v <= 0 for _, v in self.worker_tokens_per_s):
            raise ValueError("ledger speeds and decay_tokens must be > 0")
        if not 0 < self.tail_quantile <= 1 or not 1 <= self.tail_min_legs <= self.tail_window:
            raise ValueError("ledger tail needs 0 < tail_quantile <= 1 and 1 <= tail_min_legs <= tail_window")


@dataclass
class _Worker:
    speed: float
    legs: OrderedDict[int, tuple[int, float]] = field(default_factory=OrderedDict)   # leg -> (tokens, sent)
    open_tokens: int = 0
    last_settle: float = float("-inf")
    weight_tokens: float = 0.0           # decayed sums behind the speed estimate
    weight_seconds: float = 0.0


@dataclass(frozen=True)
class Leg:
    """A handle for one open leg; settle it exactly once."""

    worker_id: str
    leg_id: int
    tokens: int


class WorkLedger:
    def __init__(self, config: LedgerConfig = LedgerConfig(), clock: Clock = time.time) -> None:
        self.config, self._clock = config, clock
        self._speeds = dict(config.worker_tokens_per_s)
        self._workers: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self._recent: deque[float] = deque()      # uncached prefill seconds of the last legs, in order
        self._recent_sorted: list[float] = []     # the same, sorted (a quantile is one index)
        self.on_change: Callable[[str], None] | None = None    # router processes: publish the worker's work

    def _get(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(self._speeds.get(worker_id, self.config.tokens_per_s))
        return w

    def open(self, worker_id: str, tokens: int) -> Leg:
        """Note a leg just sent to the worker with `tokens` of prefill work: its uncached prompt tokens, plus
        any KV pool loads at their cost (`RoutingContext.work_tokens`)."""
        w, leg = self._get(worker_id), Leg(worker_id, next(self._ids), max(int(tokens), 0))
        w.legs[leg.leg_id] = (leg.tokens, self._clock())
        w.open_tokens += leg.tokens
        if leg.tokens:                             # a decode leg after a transfer computes no prompt
            self._remember(leg.tokens / w.speed)
        if self.on_change is not None:
            self.on_change(worker_id)
        return leg

    def _remember(self, seconds: float) -> None:
        self._recent.append(seconds)
        bisect.insort(self._recent_sorted, seconds)
        if len(self._recent) > self.config.tail_window:
            gone = self._recent.popleft()
            del self._recent_sorted[bisect.bisect_left(self._recent_sorted, gone)]

    def tail_prefill_s(self) -> float | None:
        """The `tail_quantile` of the last `tail_window` legs' uncached prefill seconds (each at its worker's
        speed when sent); None until `tail_min_legs` legs were opened."""
        ordered = self._recent_sorted
        if len(ordered) < self.config.tail_min_legs:
            return None
        return ordered[min(int(self.config.tail_quantile * len(ordered)), len(ordered) - 1)]

    def settle(self, leg: Leg, *, calibrate: bool = True) -> None:
        """The leg's answer arrived (or it failed / was cancelled: `calibrate=False`). Idempotent."""
        w = self._workers.get(leg.worker_id)
        if w is None or leg.leg_id not in w.legs:
            return
        tokens, sent = w.legs.pop(leg.leg_id)
        w.open_tokens -= tokens
        now = self._clock()
        busy = now - max(sent, w.last_settle)
        w.last_settle = now
        if calibrate and self.config.calibrate and tokens >= self.config.min_leg_tokens and busy > 0:
            keep = 0.5 ** (tokens / self.config.decay_tokens)
            w.weight_tokens = keep * w.weight_tokens + tokens
            w.weight_seconds = keep * w.weight_seconds + busy
            w.speed = w.weight_tokens / w.weight_seconds
        if self.on_change is not None:
            self.on_change(leg.worker_id)

    def tokens_per_s(self, worker_id: str) -> float:
        return self._get(worker_id).speed if worker_id in self._workers else \
            self._speeds.get(worker_id, self.config.tokens_per_s)

    def backlog_s(self, worker_id: str) -> float:
        """Seconds of sent, unanswered prefill work left on the worker (0 when none is open)."""
        w = self._workers.get(worker_id)
        if w is None or not w.legs:
            return 0.0
        head_tokens, head_sent = next(iter(w.legs.values()))
        progress = (self._clock() - max(head_sent, w.last_settle)) * w.speed
        return max(w.open_tokens - min(max(progress, 0.0), head_tokens), 0) / w.speed

    def view(self, worker_id: str) -> tuple[float, float]:
        """(backlog_s, tokens_per_s) in one lookup: placement reads both for every worker on every request."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0.0, self._speeds.get(worker_id, self.config.tokens_per_s)
        return (self.backlog_s(worker_id) if w.legs else 0.0), w.speed

    def backlog_bounds(self, worker_id: str) -> tuple[float, float]:
        """(backlog_s now, the backlog it falls to once the oldest leg's progress is spent): with no
        leg opened or settled in between, backlog_s(t) = max(floor, now_value - (t - now))."""
        w = self._workers.get(worker_id)
        if w is None or not w.legs:
            return 0.0, 0.0
        head_tokens = next(iter(w.legs.values()))[0]
        return self.backlog_s(worker_id), max(w.open_tokens - head_tokens, 0) / w.speed

    def open_legs(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.legs)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
