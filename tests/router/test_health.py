from __future__ import annotations

import pytest

from router.placement import (
    BreakerConfig,
    CircuitBreaker,
    CircuitState,
    HealthConfig,
    HealthTracker,
)

CLOSED, OPEN, HALF = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN
STREAK = BreakerConfig(consecutive_failures=3, min_requests=100, cooldown_s=30.0)
RATE = BreakerConfig(consecutive_failures=100, failure_rate=0.5, min_requests=4, window_s=60.0)
TWO_PROBES = BreakerConfig(consecutive_failures=3, min_requests=100, cooldown_s=30.0, half_open_successes=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(config: BreakerConfig, script: str) -> CircuitBreaker:
    """Script tokens: S = success, F = failure, +N = advance the clock N seconds."""
    clock = FakeClock()
    breaker = CircuitBreaker(config, clock)
    for token in script.split():
        if token.startswith("+"):
            clock.now += float(token[1:])
        else:
            {"S": breaker.record_success, "F": breaker.record_failure}[token]()
    return breaker


@pytest.mark.parametrize("config,script,expected", [
    (STREAK, "", CLOSED),
    (STREAK, "F F", CLOSED),
    (STREAK, "F F F", OPEN),                     # consecutive failures
    (STREAK, "F F S F F", CLOSED),               # a success resets the streak
    (STREAK, "F F S F F F", OPEN),
    (STREAK, "F F F +29", OPEN),
    (STREAK, "F F F +30", HALF),                 # cool-down elapsed
    (STREAK, "F F F +30 S", CLOSED),             # probe succeeded
    (STREAK, "F F F +30 F", OPEN),               # probe failed
    (STREAK, "F F F +30 F +29", OPEN),           # ... and the cool-down restarted
    (STREAK, "F F F +30 F +30", HALF),
    (STREAK, "F F F S", OPEN),                   # late success while open is ignored
    (STREAK, "F F F +20 F +10", HALF),           # late failure does not extend the cool-down
    (STREAK, "F F F +30 S F F", CLOSED),         # closing reset the streak
    (TWO_PROBES, "F F F +30 S", HALF),
    (TWO_PROBES, "F F F +30 S S", CLOSED),
    (TWO_PROBES, "F F F +30 S F", OPEN),
    (RATE, "S S S F", CLOSED),                   # 1/4 < 0.5
    (RATE, "S S F F", OPEN),                     # 2/4 >= 0.5
    (RATE, "S F S", CLOSED),                     # 2 of 3 failed, but fewer than min_requests
    (RATE, "F F +59 S F", OPEN),                 # 3/4 within the window
    (RATE, "F F +61 S S F", CLOSED),             # the old failures left the window: 1/3
])
def test_circuit_breaker_transitions(config, script, expected):
    assert run(config, script).state is expected


def test_failure_rate_is_windowed():
    breaker = run(RATE, "F S S")
    assert breaker.failure_rate() == pytest.approx(1 / 3)
    assert run(RATE, "F S S +61").failure_rate() == 0.0


@pytest.mark.parametrize("kwargs", [{"consecutive_failures": 0}, {"failure_rate": 0.0},
                                    {"failure_rate": 1.5}, {"window_s": 0.0}, {"cooldown_s": -1.0}])
def test_breaker_config_validation(kwargs):
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)


def tracker(clock: FakeClock | None = None) -> HealthTracker:
    return HealthTracker(HealthConfig(unhealthy_after=2, healthy_after=1, breaker=STREAK), clock or FakeClock())


@pytest.mark.parametrize("checks,healthy", [
    ([], True),                                  # new workers start healthy
    ([False], True),
    ([False, False], False),
    ([False, False, True], True),
    ([False, True, False], True),                # a pass resets the failure streak
    ([True, False, False, False], False),
])
def test_active_checks(checks, healthy):
    t = tracker()
    for ok in checks:
        t.record_check("w", ok)
    assert t.is_healthy("w") is healthy


def test_passive_outcomes_drive_circuit_and_health():
    clock = FakeClock()
    t = tracker(clock)
    for _ in range(3):
        t.record_outcome("w", ok=False)
    t.record_check("w", ok=False)
    t.record_check("w", ok=False)
    assert (t.is_healthy("w"), t.circuit("w")) == (False, OPEN)
    assert t.circuit("other") is CLOSED and t.is_healthy("other")
    clock.now += 30
    assert t.circuit("w") is HALF
    t.record_outcome("w", ok=True)
    t.record_check("w", ok=True)
    assert (t.is_healthy("w"), t.circuit("w")) == (True, CLOSED)   # healthy, closed again
    t.record_outcome("w", ok=False)
    t.forget("w")
    assert t.circuit("w") is CLOSED


def test_checks_and_outcomes_are_separate_signals():
    t = tracker()
    for _ in range(5):
        t.record_check("w", ok=False)
    assert t.circuit("w") is CLOSED and not t.is_healthy("w")


def test_requests_that_cannot_be_sent_say_nothing_about_the_worker():
    """A request the router could not even build (e.g. an illegal header) is not a worker failure."""
    import httpx

    from router.transport.upstream import classify
    local = classify(httpx.LocalProtocolError("illegal header value"), "decode")
    assert local.health_outcome is None and local.status == 500
    assert classify(httpx.ConnectError("refused"), "decode").health_outcome is False
    assert classify(httpx.ReadTimeout("slow"), "decode").health_outcome is False


def test_view_reads_health_and_circuit_as_their_own_calls_do():
    from router.placement.health import BreakerConfig, HealthConfig, HealthTracker
    tracker = HealthTracker(HealthConfig(unhealthy_after=2, breaker=BreakerConfig(consecutive_failures=2)))
    tracker.record_check("sick", False)
    tracker.record_check("sick", False)
    tracker.record_outcome("tripped", False)
    tracker.record_outcome("tripped", False)
    tracker.record_check("fine", True)
    for wid in ("sick", "tripped", "fine", "never-seen"):
        assert tracker.view(wid) == (tracker.is_healthy(wid), tracker.circuit(wid)), wid
    assert tracker.view("sick")[0] is False and tracker.view("tripped")[1] != tracker.view("fine")[1]
