"""Transfer-aware P/D decisions (router/placement/transfer.py): the fitted pull cost, the pure rule, and the
router in-process, where slow measured pulls send short prompts decode-only while long ones still split."""
from __future__ import annotations

import asyncio

import pytest

from router.placement.transfer import (
    TransferCostConfig,
    TransferCosts,
    TransferFit,
    coefficients,
    expected_seconds,
    observe,
    transfer_decision,
)
from shared.prompt.prepare import PreparedPrompt
from tests.router.fake_session import D1, KTP, P1, FakeSession, Reply, chat, count, orchestrator, trace

CFG = TransferCostConfig()


@pytest.mark.parametrize(("uncached", "threshold", "transfer_s", "speed", "expected"), [
    (10, 32, None, 1000.0, ("decode-only", "below-threshold")),
    (10, 32, 0.0, 1000.0, ("decode-only", "below-threshold")),          # the threshold is asked first
    (100, 32, None, 1000.0, ("prefill-decode", "transfer-unknown")),    # no measurement: today's rule
    (100, 32, 0.05, 1000.0, ("prefill-decode", "transfer-cheaper")),    # 50 ms to move < 100 ms to compute
    (100, 32, 0.2, 1000.0, ("decode-only", "transfer-slower")),         # 200 ms to move > 100 ms to compute
    (100, 32, 0.1, 1000.0, ("prefill-decode", "transfer-cheaper")),     # a tie keeps the split
    (100, 0, 5.0, 0.0, ("prefill-decode", "transfer-unknown")),         # no speed known: cannot compare
])
def test_transfer_decision(uncached, threshold, transfer_s, speed, expected):
    assert transfer_decision(uncached, threshold, transfer_s, speed) == expected


def fit_of(*samples: tuple[int, float], config: TransferCostConfig = CFG) -> TransferFit:
    fit = TransferFit()
    for tokens, seconds in samples:
        fit = observe(fit, tokens, seconds, config)
    return fit


@pytest.mark.parametrize(("samples", "fixed", "per_token"), [
    (((1000, 0.06), (2000, 0.07)), 0.05, 1e-5),                   # a fixed part plus a per-token part
    (((1000, 0.06), (1000, 0.06)), 0.0, 6e-5),                    # one size: all of it per token
    (((1000, 0.05), (3000, 0.05)), 0.05, 0.0),                    # flat: a fixed cost only
    (((1000, 0.0), (2000, 0.1)), 0.0, 0.1 / 3000),                # a negative fixed part: through the origin
])
def test_the_fit_recovers_fixed_and_per_token_costs(samples, fixed, per_token):
    a, b = coefficients(fit_of(*samples, config=TransferCostConfig(decay_tokens=1e12)))
    assert (a, b) == (pytest.approx(fixed, abs=1e-9), pytest.approx(per_token, abs=1e-12))


def test_estimates_need_measurements_and_follow_a_link_that_slows():
    assert expected_seconds(TransferFit(), 100, CFG) is None
    assert expected_seconds(fit_of((1000, 0.1)), 500, TransferCostConfig(enabled=False)) is None
    assert expected_seconds(fit_of((1000, 0.1)), 500, TransferCostConfig(min_samples=2)) is None
    assert expected_seconds(fit_of((1000, 0.1)), 500, CFG) == pytest.approx(0.05)
    slowed = fit_of(*[(1000, 0.01)] * 5, *[(1000, 1.0)] * 200)     # decay forgets the fast link
    assert expected_seconds(slowed, 1000, CFG) == pytest.approx(1.0, rel=0.05)
    costs = TransferCosts()
    assert costs.expected_s("d", 1000) is None
    costs.observe("d", 1000, 0.1)
    costs.observe("d", 0, 5.0)                                      # nothing moved: ignored
    costs.observe("e", 1000, 0.3)
    assert costs.expected_s("d", 1000) == pytest.approx(0.1) and costs.expected_s("e", 1000) == pytest.approx(0.3)
    assert costs.expected_s("new", 1000) == pytest.approx(0.2, rel=0.02)    # not measured: the pool's estimate
    costs.forget("d")
    assert costs.expected_s("d", 1000) == pytest.approx(0.2, rel=0.02)


def test_invalid_config_is_refused():
    with pytest.raises(ValueError):
        TransferCostConfig(decay_tokens=0)
    with pytest.raises(ValueError):
        TransferCostConfig(min_samples=0)


PREFILLED = Reply(body={"choices": [], "kv_transfer_params": KTP})


def answer(pull_s: float | None = None) -> Reply:
    headers = {} if pull_s is None else {"x-kv-pull-seconds": f"{pull_s:.6f}"}
    return Reply(body={"id": "c1", "choices": [{"message": {"content": "ok"}}]}, headers=headers)


def tokens(start: int, n: int) -> PreparedPrompt:
    return PreparedPrompt(token_ids=list(range(start, start + n)))      # disjoint ranges: nothing cached


def decisions(transfer_aware: bool) -> list[str]:
    """Two measured pulls (1000 tokens in 60 ms, 2000 in 70 ms: ~50 ms fixed, 10 us a token) to a decode
    worker that prefills 10,000 tokens/s (100 us a token), then a short and a long prompt."""
    s = FakeSession({P1: [PREFILLED] * 4, D1: [answer(0.06), answer(0.07), answer(), answer(0.09)]})
    orch = orchestrator(s, prefill=(P1,), decode=(D1,), prefill_tokens_per_s=10000.0, transfer_aware=transfer_aware)
    out = []
    for start, n in ((1, 1000), (10001, 2000), (20001, 100), (30001, 4000)):
        t = trace()
        asyncio.run(orch.handle(t, chat(), tokens(start, n)))
        out.append(t.decision)
    if transfer_aware:
        assert count(orch, "decision_reasons_total", decision="prefill-decode", reason="transfer-unknown") == 1
        assert count(orch, "decision_reasons_total", decision="decode-only", reason="transfer-slower") == 1
        assert count(orch, "decision_reasons_total", decision="prefill-decode", reason="transfer-cheaper") == 2
        assert "kv_transfer_params" not in s.to(D1)[2]                  # the short prompt was computed on D
    return out


def test_slow_pulls_send_short_prompts_decode_only_and_long_ones_still_split():
    assert decisions(True) == ["prefill-decode", "prefill-decode", "decode-only", "prefill-decode"]


def test_without_transfer_awareness_the_threshold_alone_decides():
    assert decisions(False) == ["prefill-decode"] * 4
