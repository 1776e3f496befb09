"""Worker health: a circuit breaker per worker for passive request outcomes, plus active checks.

Circuit breaker states (time comes from an injected clock, so it is a deterministic state machine):

    CLOSED --(consecutive_failures in a row, or failure_rate over window_s with >= min_requests)--> OPEN
    OPEN   --(cooldown_s elapsed; checked lazily when the state is read)------------------------> HALF_OPEN
    HALF_OPEN --(half_open_successes successes)--> CLOSED       HALF_OPEN --(any failure)--> OPEN

Outcomes reported while OPEN (late answers to requests sent before it opened) are ignored; they
neither close the circuit nor extend the cool-down.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.placement.types import CircuitState

Clock = Callable[[], float]


@dataclass(frozen=True)
class BreakerConfig:
    consecutive_failures: int = 5
    failure_rate: float = 0.5
    min_requests: int = 20
    window_s: float = 60.0
    cooldown_s: float = 30.0
    half_open_successes: int = 1

    def __post_init__(self) -> None:
        if min(self.consecutive_failures, self.min_requests, self.half_open_successes) < 1:
            raise ValueError("breaker counts must be >= 1")
        if not 0.0 < self.failure_rate <= 1.0 or self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("breaker needs 0 < failure_rate <= 1, window_s > 0, cooldown_s >= 0")


class CircuitBreaker:
    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Clock = time.monotonic) -> None:
        self.config, self._clock = config, clock
        self._state = CircuitState.CLOSED
        self._opened_at = 0.0
        self._streak = 0                                  # consecutive failures (closed)
        self._probes_ok = 0                               # successes while half-open
        self._window: deque[tuple[float, bool]] = deque()  # (time, ok), closed state only

    @property
    def state(self) -> CircuitState:
        """Current state; moves OPEN -> HALF_OPEN once the cool-down has elapsed."""
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.config.cooldown_s:
            self._state, self._probes_ok = CircuitState.HALF_OPEN, 0
        return self._state

    def record_success(self) -> None:
        state = self.state
        if state is CircuitState.CLOSED:
            self._streak = 0
            self._observe(ok=True)
        elif state is CircuitState.HALF_OPEN:
            self._probes_ok += 1
            if self._probes_ok >= self.config.half_open_successes:
                self._close()

    def record_failure(self) -> None:
        state = self.state
        if state is CircuitState.CLOSED:
            self._streak += 1
            self._observe(ok=False)
            if self._streak >= self.config.consecutive_failures or self._rate_exceeded():
                self._open()
        elif state is CircuitState.HALF_OPEN:
            self._open()

    def failure_rate(self) -> float:
        """Failures / outcomes within the window (0.0 when empty)."""
        self._trim()
        return sum(not ok for _, ok in self._window) / len(self._window) if self._window else 0.0

    def _observe(self, ok: bool) -> None:
        self._window.append((self._clock(), ok))
        self._trim()

    def _trim(self) -> None:
        horizon = self._clock() - self.config.window_s
        while self._window and self._window[0][0] <= horizon:
            self._window.popleft()

    def _rate_exceeded(self) -> bool:
        cfg = self.config
        return len(self._window) >= cfg.min_requests and self.failure_rate() >= cfg.failure_rate

    def _open(self) -> None:
        self._state, self._opened_at = CircuitState.OPEN, self._clock()
        self._window.clear()

    def _close(self) -> None:
        self._state, self._streak = CircuitState.CLOSED, 0
        self._window.clear()


@dataclass(frozen=True)
class HealthConfig:
    """Active checks: `unhealthy_after` failed checks in a row mark a worker unhealthy,
    `healthy_after` passed checks in a row mark it healthy again. New workers start healthy."""

    unhealthy_after: int = 2
    healthy_after: int = 1
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        if self.unhealthy_after < 1 or self.healthy_after < 1:
            raise ValueError("health thresholds must be >= 1")


@dataclass
class _Worker:
    breaker: CircuitBreaker
    healthy: bool = True
    streak: int = 0          # > 0: passed checks in a row; < 0: failed checks in a row


class HealthTracker:
    """Per-worker health: active check results drive `healthy`, passive request outcomes drive the
    circuit. What counts as a failed outcome (connect error, 5xx, timeout; not a 4xx caused by the
    client) is the caller's call."""

    def __init__(self, config: HealthConfig = HealthConfig(), clock: Clock = time.monotonic) -> None:
        self.config, self._clock = config, clock
        self._workers: dict[str, _Worker] = {}

    def _get(self, worker_id: str) -> _Worker:
        if worker_id not in self._workers:
            self._workers[worker_id] = _Worker(CircuitBreaker(self.config.breaker, self._clock))
        return self._workers[worker_id]

    def record_check(self, worker_id: str, ok: bool) -> None:
        w = self._get(worker_id)
        w.streak = max(w.streak, 0) + 1 if ok else min(w.streak, 0) - 1
        if w.streak >= self.config.healthy_after:
            w.healthy = True
        elif -w.streak >= self.config.unhealthy_after:
            w.healthy = False

    def record_outcome(self, worker_id: str, ok: bool) -> None:
        breaker = self._get(worker_id).breaker
        if ok:
            breaker.record_success()
        else:
            breaker.record_failure()

    def is_healthy(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is None or w.healthy

    def circuit(self, worker_id: str) -> CircuitState:
        w = self._workers.get(worker_id)
        return CircuitState.CLOSED if w is None else w.breaker.state

    def view(self, worker_id: str) -> tuple[bool, CircuitState]:
        """(is_healthy, circuit) in one lookup: placement reads both for every worker on every request."""
        w = self._workers.get(worker_id)
        return (True, CircuitState.CLOSED) if w is None else (w.healthy, w.breaker.state)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
