"""`kimi-pd bench` against a stub server with known delays recovers them (TTFT, TPOT within 10%)."""
from __future__ import annotations

import pytest

from tests.bench.helpers import LATENCY_KEYS, assert_valid_pngs, run_bench
from tests.e2e.fleet import Fleet

pytestmark = pytest.mark.timeout(240)
# delays large against the stub's own overhead and asyncio's sleep overshoot on a loaded machine
FIRST_MS, TOKEN_MS, TOKENS = 450.0, 50.0, 8


@pytest.fixture(scope="module")
def stub(tmp_path_factory, bench_model):
    with Fleet(tmp_path_factory.mktemp("bench-stub"), bench_model) as fleet:
        proc = fleet.stub("both", "stub", "--tokens", "64", "--token-delay-ms", str(TOKEN_MS),
                          "--first-token-delay-ms", str(FIRST_MS))
        fleet.wait(proc)
        yield proc.url


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_recovers_injected_delays(stub, bench_model, tmp_path, backend):
    result, pngs = run_bench(stub, bench_model, tmp_path, "--backend", backend, "--num-prompts", "16",
                             "--random-input-len", "48", "--random-output-len", str(TOKENS), "--max-concurrency", "8",
                             "--request-rate", "20", "--seed", "1", "--goodput", "ttft:1000", "tpot:100")
    assert result["completed"] == 16 and result["failed"] == 0
    assert set(LATENCY_KEYS) <= set(result)
    # the stub's first token comes FIRST + TOKEN ms after the request, each later one TOKEN ms apart;
    # medians within 10% (a loaded 2-core machine delays a few chunks), means within 20%
    measured = {k: result[k] for k in ("median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "mean_tpot_ms",
                                       "median_itl_ms", "median_e2el_ms")}
    expected_e2el = FIRST_MS + TOKEN_MS * TOKENS
    assert measured["median_ttft_ms"] == pytest.approx(FIRST_MS + TOKEN_MS, rel=0.10), measured
    assert measured["median_tpot_ms"] == pytest.approx(TOKEN_MS, rel=0.10), measured
    assert measured["median_itl_ms"] == pytest.approx(TOKEN_MS, rel=0.10), measured
    assert measured["median_e2el_ms"] == pytest.approx(expected_e2el, rel=0.10), measured
    assert measured["mean_ttft_ms"] == pytest.approx(FIRST_MS + TOKEN_MS, rel=0.20), measured
    assert measured["mean_tpot_ms"] == pytest.approx(TOKEN_MS, rel=0.20), measured
    assert result["total_output_tokens"] == 16 * TOKENS
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])   # every request meets the SLOs
    assert_valid_pngs(pngs)


def test_goodput_counts_slo_misses(stub, bench_model, tmp_path):
    """An SLO below the injected TTFT: no request is good."""
    result, _ = run_bench(stub, bench_model, tmp_path, "--num-prompts", "4", "--random-input-len", "16",
                          "--random-output-len", "3", "--goodput", f"ttft:{FIRST_MS / 2}", "--no-plots")
    assert result["completed"] == 4 and result["request_goodput"] == 0.0
