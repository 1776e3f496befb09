"""Metric definitions (vllm bench serve's) on hand-built request outputs with known timings."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kimi_pd.bench.client import RequestOutput, _token_text
from kimi_pd.bench.metrics import compute, parse_goodput, per_second
from kimi_pd.bench.runner import arrival_offsets


def out(ttft: float, gaps: list[float], start: float = 0.0, prompt: int = 10, cached: int = 0,
        tokens: int | None = None) -> RequestOutput:
    return RequestOutput(success=True, prompt_len=prompt, output_tokens=len(gaps) + 1 if tokens is None else tokens,
                         cached_tokens=cached, ttft=ttft, itl=list(gaps), latency=ttft + sum(gaps), start_time=start)


def test_latency_metrics_follow_vllm_definitions():
    a = out(0.100, [0.010] * 4)                       # tpot 10 ms
    b = out(0.300, [0.030] * 2, start=0.5)            # tpot 30 ms
    failed = RequestOutput(success=False, prompt_len=99, error="HTTP 500: boom")
    r = compute([a, b, failed], duration_s=2.0, percentiles=(50, 99.5), goodput={})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 20 and r["total_output_tokens"] == 8
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(20.0)
    assert r["mean_itl_ms"] == pytest.approx((4 * 10 + 2 * 30) / 6)
    assert r["mean_e2el_ms"] == pytest.approx((140 + 360) / 2)
    assert r["p99.5_ttft_ms"] == pytest.approx(float(np.percentile([100, 300], 99.5)))
    assert "p50_e2el_ms" in r and "p99_ttft_ms" not in r
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(14.0)
    assert r["request_goodput"] is None
    assert r["detail"]["errors"] == ["", "", "HTTP 500: boom"] and r["detail"]["output_lens"] == [5, 3, 0]


def test_tpot_uses_reported_token_count_not_chunks():
    # 2 chunks but 5 tokens (a server that bundles tokens): tpot = (latency - ttft) / 4
    r = compute([out(0.1, [0.04], tokens=5)], 1.0, (99,), {})
    assert r["mean_tpot_ms"] == pytest.approx(10.0)


def test_goodput_counts_requests_meeting_every_slo():
    fast, slow_first, slow_decode = out(0.05, [0.01] * 3), out(0.5, [0.01] * 3), out(0.05, [0.2] * 3)
    r = compute([fast, slow_first, slow_decode], 1.0, (99,), parse_goodput(["ttft:100", "tpot:50"]))
    assert r["request_goodput"] == pytest.approx(1.0)
    assert compute([fast, slow_first, slow_decode], 1.0, (99,), {"ttft": 100})["request_goodput"] == 2.0


def test_cached_token_ratio():
    r = compute([out(0.1, [0.01], prompt=100, cached=64), out(0.1, [0.01], prompt=100)], 1.0, (99,), {})
    assert r["total_cached_tokens"] == 64 and r["cached_token_ratio"] == pytest.approx(0.32)
    r = compute([out(0.1, [0.01], cached=8), out(0.3, [0.01]), out(0.5, [0.01])], 1.0, (99,), {})
    assert (r["cold_requests"], r["prefix_hit_requests"]) == (2, 1)
    assert r["median_ttft_cold_ms"] == pytest.approx(400.0) and r["median_ttft_prefix_hit_ms"] == pytest.approx(100.0)


def test_all_failed_gives_zeros_not_errors():
    r = compute([RequestOutput(error="x")], 1.0, (99,), {"ttft": 1})
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0 and r["max_concurrent_requests"] == 0


def test_per_second_series():
    tokens, running = per_second([out(0.5, [1.0, 1.0]), out(0.2, [0.1], start=1.0)])
    assert sum(tokens) == 5 and len(tokens) == 4
    assert running[0] == 1 and running[1] == 2


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:x", "tpot:-1"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_arrivals_poisson_rate_and_infinite_rate():
    rng = np.random.default_rng(0)
    t = arrival_offsets(4001, 50.0, 1.0, rng)
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    assert 4000 / t[-1] == pytest.approx(50.0, rel=0.05)
    gaps = np.diff(t)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)         # exponential gaps
    smooth = np.diff(arrival_offsets(4001, 50.0, 16.0, rng))
    assert np.std(smooth) / np.mean(smooth) == pytest.approx(0.25, rel=0.15)   # gamma(16): cv = 1/4
    assert arrival_offsets(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]


def test_token_chunks_exclude_role_and_finish_only_chunks():
    assert _token_text({"delta": {"role": "assistant", "content": ""}}, chat=True) is None
    assert _token_text({"delta": {}, "finish_reason": "stop"}, chat=True) is None
    assert _token_text({"delta": {"content": " hi"}}, chat=True) == " hi"
    assert _token_text({"delta": {"reasoning_content": "hm"}}, chat=True) == "hm"
    assert _token_text({"text": " a", "finish_reason": None}, chat=False) == " a"
    assert _token_text({"text": "", "finish_reason": None}, chat=False) == ""        # an empty token step
    assert _token_text({"text": "", "finish_reason": "length"}, chat=False) is None
