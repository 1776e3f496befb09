"""What moving a prompt's state to a decode worker costs, learnt from the decode workers' own reports.

A decode worker that pulled a prefill state says how long the pull took (`x-kv-pull-seconds`). Per
decode worker the router fits pull time against the tokens moved, as a fixed part plus a per-token
part (`seconds = fixed_s + per_token_s * tokens`), from decayed sums (token-weighted like the work
ledger's speed, so the estimate follows a link whose bandwidth changes). The fixed part is what makes
short prompts cheaper to recompute than to move: a connection, a lease handshake and a link's queue
cost the same for 10 tokens as for 10,000.

The P/D rule (`transfer_decision`) then compares that expected pull with the time the decode worker
would take to prefill the uncached tokens itself (the ledger's calibrated speed for it). With no
measurement yet the rule abstains and the token threshold alone decides, as it always did.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from router.placement.pipeline import Decision

# why a decision was made: the metric `decision_reasons_total{decision, reason}` counts these
Reason = Literal["below-threshold", "no-prefill-worker", "transfer-unknown", "transfer-cheaper", "transfer-slower"]


@dataclass(frozen=True)
class TransferCostConfig:
    """`decay_tokens`: weight kept by the old sums per measured transfer's share of `decay_tokens`
    (0.5 ** (tokens / decay_tokens)); `min_samples`: transfers measured before the estimate is used;
    `enabled=False` never consults it (the threshold alone decides)."""

    decay_tokens: float = 50000.0
    min_samples: int = 1
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.decay_tokens <= 0 or self.min_samples < 1:
            raise ValueError("decay_tokens must be > 0 and min_samples >= 1")


@dataclass(frozen=True)
class TransferFit:
    """Decayed sums behind one decode worker's estimate: weights n, tokens t, seconds s, t*t and t*s."""

    n: float = 0.0
    t: float = 0.0
    s: float = 0.0
    tt: float = 0.0
    ts: float = 0.0
    samples: int = 0


def observe(fit: TransferFit, tokens: int, seconds: float, config: TransferCostConfig) -> TransferFit:
    """The fit with one more measured transfer of `tokens` taking `seconds`."""
    if tokens <= 0 or seconds < 0:
        return fit
    keep = 0.5 ** (tokens / config.decay_tokens)
    return TransferFit(keep * fit.n + 1.0, keep * fit.t + tokens, keep * fit.s + seconds,
                       keep * fit.tt + tokens * tokens, keep * fit.ts + tokens * seconds, fit.samples + 1)


def coefficients(fit: TransferFit) -> tuple[float, float]:
    """(fixed_s, per_token_s), both >= 0, by least squares; one transfer size seen gives a fixed part of 0
    (all of the cost is charged per token, which prices short prompts no worse than long ones)."""
    if fit.n <= 0 or fit.t <= 0:
        return 0.0, 0.0
    det = fit.n * fit.tt - fit.t * fit.t
    if det > 1e-9 * fit.n * fit.tt:
        per_token = (fit.n * fit.ts - fit.t * fit.s) / det
        fixed = (fit.s - per_token * fit.t) / fit.n
        if per_token >= 0 and fixed >= 0:
            return fixed, per_token
        if per_token < 0:
            return fit.s / fit.n, 0.0              # time does not grow with size: a fixed cost only
    return 0.0, fit.s / fit.t                       # through the origin: a per-token cost only


def expected_seconds(fit: TransferFit, tokens: int, config: TransferCostConfig) -> float | None:
    """Expected seconds to move `tokens` tokens' state, or None while too few transfers were measured."""
    if not config.enabled or fit.samples < config.min_samples:
        return None
    fixed, per_token = coefficients(fit)
    return fixed + per_token * max(tokens, 0)


def transfer_decision(uncached_tokens: int, threshold_tokens: int, transfer_s: float | None,
                      decode_tokens_per_s: float) -> tuple[Decision, Reason]:
    """Decode-only below the threshold; above it, prefill-decode unless moving the state is expected to take
    longer than the decode worker prefilling the uncached tokens itself. Unknown cost: prefill-decode."""
    if uncached_tokens < threshold_tokens:
        return "decode-only", "below-threshold"
    if transfer_s is None or decode_tokens_per_s <= 0:
        return "prefill-decode", "transfer-unknown"
    if transfer_s > uncached_tokens / decode_tokens_per_s:
        return "decode-only", "transfer-slower"
    return "prefill-decode", "transfer-cheaper"


class TransferCosts:
    """Per decode worker fits, and one over every pull that a worker not measured yet borrows (its links
    are most likely the pool's). The only state. Not thread-safe (the router's event loop owns it).

    `on_observe` (router processes) hears every pull measured here, so the sibling processes learn the
    same costs (a pull reported to one process would otherwise price the next prompt in that one only)."""

    def __init__(self, config: TransferCostConfig = TransferCostConfig()) -> None:
        self.config = config
        self._fits: dict[str, TransferFit] = {}
        self._pool = TransferFit()
        self.on_observe: Callable[[str, int, float], None] | None = None

    def observe(self, worker_id: str, tokens: int, seconds: float, *, local: bool = True) -> None:
        """One measured pull; `local=False`: a sibling's, replayed (not told again). Disabled: nothing kept."""
        if not self.config.enabled:
            return
        self._fits[worker_id] = observe(self._fits.get(worker_id, TransferFit()), tokens, seconds, self.config)
        self._pool = observe(self._pool, tokens, seconds, self.config)
        if local and self.on_observe is not None:
            self.on_observe(worker_id, tokens, seconds)

    def expected_s(self, worker_id: str, tokens: int) -> float | None:
        fit = self._fits.get(worker_id, TransferFit())
        return expected_seconds(fit if fit.samples >= self.config.min_samples else self._pool, tokens, self.config)

    def forget(self, worker_id: str) -> None:
        self._fits.pop(worker_id, None)
