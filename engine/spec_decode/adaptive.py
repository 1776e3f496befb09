"""Adaptive speculation: how many tokens to draft this step (K, 0 = off), from a cost model.

A verify step at batch b with K_r drafts for request r emits `sum_r (1 + E_r(K_r))` tokens, where
`E_r(K)` is the expected number of accepted drafts, and costs one target step over `1 + mean K`
query tokens per request plus one draft step over a block of `max K_r`. Plain decoding emits b
tokens per target step at q = 1. A batch where only some requests verify runs their rows apart from
the one-token rows (the KDA path differs), so its step is costed as the plain step plus what verifying
adds for those requests alone: `target(b, 1) + target(d, 1 + m/d) - target(d, 1)` for d requests
drafting m tokens in all (with d = b, exactly the table's `target(b, 1 + m/b)`). `choose_drafts`
picks the K_r maximising tokens per second and returns all zeros (speculation off) unless that beats
plain decoding by `min_gain`.

Everything here but `AcceptanceTracker` and `CostCorrection` is a pure function of its arguments; the
costs come from `engine/spec_decode/calibrate.py` (measured at first use) or from the config's override.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Any


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear through (xs, ys); linear extrapolation past either end (costs keep growing)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if x > xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _interp2(xs: tuple[float, ...], ys: tuple[float, ...], table: tuple[tuple[float, ...], ...],
             x: float, y: float) -> float:
    """Bilinear: along y within the two rows around x, then along x."""
    if len(xs) == 1:
        return _interp(xs, (_interp(ys, table[0], y),), x)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return _interp(xs[i - 1: i + 1], (_interp(ys, table[i - 1], y), _interp(ys, table[i], y)), x)


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step. target[i][j]: a target step at batch batch_sizes[i] with query_lens[j]
    tokens per request (1 = plain decode, 1 + K = verifying K drafts). draft[i][j]: a draft step for
    batch_sizes[i] requests with a block of draft_lens[j] tokens (context rows + proposal)."""

    batch_sizes: tuple[int, ...]
    query_lens: tuple[int, ...]
    target: tuple[tuple[float, ...], ...]
    draft_lens: tuple[int, ...]
    draft: tuple[tuple[float, ...], ...]

    def target_s(self, batch: int, query_len: float) -> float:
        return self._lookup(1, self.target, batch, query_len)

    def draft_s(self, batch: int, block: int) -> float:
        return self._lookup(2, self.draft, batch, block)

    def _lookup(self, axis: int, table: tuple[tuple[float, ...], ...], batch: int, length: float) -> float:
        """Interpolated seconds, remembered: the policy asks for the same few points every step (a plan
        at batch 16 interpolates some 130 of them, which cost about a tenth of a tiny-chat step uncached)."""
        key = (axis, batch, length)
        if (seconds := self._memo.get(key)) is None:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            seconds = self._memo[key] = _interp2(self._axes[0], self._axes[axis], table, batch, length)
        return seconds

    @functools.cached_property
    def _memo(self) -> dict[tuple[int, int, float], float]:
        return {}

    @functools.cached_property
    def _axes(self) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        return (tuple(map(float, self.batch_sizes)), tuple(map(float, self.query_lens)),
                tuple(map(float, self.draft_lens)))

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "query_lens": list(self.query_lens),
                "target": [list(r) for r in self.target], "draft_lens": list(self.draft_lens),
                "draft": [list(r) for r in self.draft]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCosts:
        """The `adaptive_costs` override; ValueError naming what is wrong."""
        try:
            costs = cls(tuple(int(b) for b in d["batch_sizes"]), tuple(int(q) for q in d["query_lens"]),
                        tuple(tuple(float(x) for x in r) for r in d["target"]),
                        tuple(int(n) for n in d["draft_lens"]), tuple(tuple(float(x) for x in r) for r in d["draft"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"adaptive_costs: expected batch_sizes, query_lens, target, draft_lens, draft ({exc})") \
                from exc
        costs.validate()
        return costs

    def validate(self) -> None:
        for name, axis in (("batch_sizes", self.batch_sizes), ("query_lens", self.query_lens),
                           ("draft_lens", self.draft_lens)):
            if not axis or list(axis) != sorted(set(axis)) or axis[0] < 1:
                raise ValueError(f"adaptive_costs.{name}: a non-empty increasing list of integers >= 1")
        for name, table, width in (("target", self.target, len(self.query_lens)),
                                   ("draft", self.draft, len(self.draft_lens))):
            if len(table) != len(self.batch_sizes) or any(len(r) != width or min(r) <= 0 for r in table):
                raise ValueError(f"adaptive_costs.{name}: one row of positive seconds per batch size, "
                                 f"one column per length")


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted drafts out of k when each is accepted with probability alpha given the ones
    before it were (geometric): sum_{i=1..k} alpha^i."""
    return sum(alpha ** i for i in range(1, k + 1))


def expected_accepted_measured(cum_rates: list[float], k: int) -> float:
    """The same from measured per-position rates: cum_rates[i] = P(at least i+1 drafts accepted)."""
    return sum(cum_rates[:k])


EXPLORE_DRAFTS = 32                    # drafts scanned before giving up when none has paid yet (choose_drafts)
# The predicted gain a plan needs over plain decoding before it drafts: a margin for the model's optimism
# (acceptance records picked because they look good regress; the cost table is a stand-in's). Measured
# with the shipped tiny-chat pair, 3 runs each (docs/dspark.md): 0.10 kept batch 16 off at 0.98-1.00x of plain
# where fixed K ran 1.02-1.05x; 0.03 speculated there as fixed K did (1.03-1.07x) and matched it at batch
# 1-8. With a draft accepting 2.8 tokens a step instead of 4.2, 0.03 cost batch 16 0.91x against 0.96x.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class Plan:
    num_drafts: tuple[int, ...]          # per request, 0 = no speculation this step
    tokens_per_s: float                  # expected, under the cost model
    plain_tokens_per_s: float
    seconds: float = 0.0                 # the table's (uncorrected) seconds of the chosen step, draft included


def choose_drafts(costs: StepCosts, alphas: list[float], caps: list[int], min_gain: float = MIN_GAIN,
                  spec_scale: float = 1.0, plain_scale: float = 1.0) -> Plan:
    """K_r per request maximising expected tokens per second; all zeros unless it beats plain by min_gain.

    alphas[r]: request r's per-draft acceptance probability; caps[r]: the most it may draft (0: none).
    spec_scale / plain_scale: observed over tabled seconds of speculating / plain steps (CostCorrection).
    The i-th draft of request r adds alpha_r^i expected tokens; for each total number of drafts m the
    best ones are the m largest gains (they decrease along a request), so scanning m covers the optimum
    of this model."""
    b = len(alphas)
    plain_s = costs.target_s(b, 1.0) if b else 1.0
    plain = b / (plain_s * plain_scale)
    gains = sorted(((alphas[r] ** i, r) for r in range(b) for i in range(1, caps[r] + 1)), reverse=True)
    best_rate, best_m, best_s = plain * (1.0 + min_gain), 0, plain_s
    ks, tokens, drafting, longest = [0] * b, float(b), 0, 0
    for m, (gain, r) in enumerate(gains, start=1):
        # a whole round of drafts without a better rate: past the peak. Before any draft has paid, look
        # further: the draft step's fixed cost makes the first few drafts lose where more of them win
        # (batch 1 on tiny-chat: one draft 1.05x plain, under the 10 % bar; two 1.15x; seven 1.3x)
        if m > best_m + b and (best_m or m > EXPLORE_DRAFTS):
            break
        drafting += not ks[r]
        ks[r] += 1
        longest = max(longest, ks[r])
        tokens += gain
        seconds = (plain_s + costs.target_s(drafting, 1.0 + m / drafting) - costs.target_s(drafting, 1.0)
                   + costs.draft_s(drafting, longest))
        if tokens / (seconds * spec_scale) > best_rate:
            best_rate, best_m, best_s = tokens / (seconds * spec_scale), m, seconds
    chosen = [0] * b
    for _, r in gains[:best_m]:
        chosen[r] += 1
    return Plan(tuple(chosen), best_rate if best_m else plain, plain, best_s)


@dataclass
class CostCorrection:
    """How far the running engine's steps are from the table, per batch size of the table: a level that
    every observed step moves (observed / tabled seconds, an exponential average, clamped to [0.5, 2]),
    and how much more (or less) than that level speculating steps cost (`spec_rel`).

    Start-up costs are measured on stand-ins with a short context and whatever else ran on the host
    then; the steps actually run say how they compare now. A host or a context that slows every step
    moves the level, which scales plain and speculating steps alike, so it cannot by itself make
    speculation look cheaper: with a correction per kind that relaxed toward the table, plain steps
    running 1.2-1.4x their tabled time and no speculating step to correct turned drafts on at batch
    12-16, where each verify step cost about three plain ones (tiny-chat, 2 shared cores). What is
    speculation's own (`spec_rel`) is learnt from speculating steps and relaxes back to 1 (`relax` per plain
    step), so one noisy stretch cannot lock the policy out of speculating."""

    weight: float = 0.1
    relax: float = 0.05
    level: dict[int, float] = field(default_factory=dict)
    spec_rel: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _bucket(costs: StepCosts, batch: int) -> int:
        return min(range(len(costs.batch_sizes)), key=lambda i: abs(costs.batch_sizes[i] - batch))

    def scale(self, costs: StepCosts, batch: int, speculating: bool) -> float:
        b = self._bucket(costs, batch)
        level = self.level.get(b, 1.0)
        return level * self.spec_rel.get(b, 1.0) if speculating else level

    def observe(self, costs: StepCosts, batch: int, speculating: bool, tabled_s: float, observed_s: float) -> None:
        b, w = self._bucket(costs, batch), self.weight
        ratio = min(2.0, max(0.5, observed_s / tabled_s))
        level, rel = self.level.get(b, 1.0), self.spec_rel.get(b, 1.0)
        if speculating:                      # the level from what the step's kind does not explain, and back
            level = self.level[b] = level * (1 - w) + ratio / rel * w
            self.spec_rel[b] = min(2.0, max(0.5, rel * (1 - w) + ratio / level * w))
        else:
            self.level[b] = level * (1 - w) + ratio * w
            self.spec_rel[b] = rel * (1 - self.relax) + self.relax


@dataclass
class AcceptanceTracker:
    """Recent acceptance, per request and over all requests (exponentially decayed counts).

    A request's alpha blends its own recent record with the global one (`request_prior_weight`
    pseudo-trials), so a new request starts at the global rate and one that stops agreeing with the
    draft is cut back within a few steps. The blend is deliberately slow: acceptance comes in bursts
    (a draft that misses its first token often gets all seven right on the next step), and a record that
    dropped below break-even after each first-token miss kept tiny-chat's batch-1 decoding off most of
    the time (1.08-1.17x plain where fixed K=7 measured 1.5-1.85x, benchmarks/results/spec_decode.md).
    A trial is one draft position the target checked: accepted drafts, plus the rejected one when the
    block stopped early."""

    prior_alpha: float = 0.6
    decay: float = 0.8
    global_decay: float = 0.98
    idle_decay: float = 0.9
    prior_weight: float = 1.5
    request_prior_weight: float = 4.0
    _accepted: float = 0.0
    _trials: float = 0.0
    per_request: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def global_alpha(self) -> float:
        return (self._accepted + self.prior_alpha * self.prior_weight) / (self._trials + self.prior_weight)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        self._accepted = self._accepted * self.global_decay + num_accepted
        self._trials = self._trials * self.global_decay + trials
        acc, tri = self.per_request.get(request_id, (0.0, 0.0))
        self.per_request[request_id] = (acc * self.decay + num_accepted, tri * self.decay + trials)

    def idle(self, request_id: str, steps: int = 1) -> None:
        """`steps` steps without drafts for the request: its record fades toward the global rate, so a
        request turned off for poor acceptance is tried again after a few steps."""
        acc, tri = self.per_request.get(request_id, (0.0, 0.0))
        fade = self.decay ** steps
        self.per_request[request_id] = (acc * fade, tri * fade)

    def idle_step(self, steps: int = 1) -> None:
        """`steps` steps where nobody drafted: the global record fades toward the prior too (slowly), so
        a policy that turned speculation off on a bad stretch probes it again some steps later."""
        fade = self.idle_decay ** steps
        self._accepted *= fade
        self._trials *= fade

    def alpha(self, request_id: str) -> float:
        acc, tri = self.per_request.get(request_id, (0.0, 0.0))
        g = self.global_alpha
        return min(0.99, (acc + g * self.request_prior_weight) / (tri + self.request_prior_weight))

    def forget(self, keep: set[str]) -> None:
        """Drop the records of requests no longer running."""
        for rid in [r for r in self.per_request if r not in keep]:
            del self.per_request[rid]
