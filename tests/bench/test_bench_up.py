"""`kimi-pd bench` against `kimi-pd up` (store + P + D + router): every request succeeds, the server
sees the requested prompt lengths, the JSON has every metric, the plots are valid PNGs, and a
Mooncake replay with shared hash ids hits the prefix cache."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.bench.helpers import LATENCY_KEYS, SUMMARY_KEYS, assert_valid_pngs, run_bench
from tests.e2e.fleet import kimi_pd_up

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def up_url(tmp_path_factory, bench_model):
    tmp = tmp_path_factory.mktemp("bench-up")
    model = tmp / "model"
    shutil.copytree(bench_model, model)
    with kimi_pd_up(["--model", str(model)], tmp / "logs") as (url, _):
        yield url


def test_bench_random_against_up(up_url, bench_model, tmp_path):
    n, in_len, out_len = 12, 40, 6
    result, pngs = run_bench(up_url, bench_model, tmp_path, "--num-prompts", str(n), "--random-input-len", str(in_len),
                             "--random-output-len", str(out_len), "--max-concurrency", "4", "--ignore-eos",
                             "--save-detailed", "--goodput", "ttft:60000", "--label", "up")
    assert result["completed"] == n and result["failed"] == 0 and result["errors"] == [""] * n
    missing = [k for k in SUMMARY_KEYS + LATENCY_KEYS if k not in result]
    assert not missing, missing
    assert result["model_id"] == "kimi-k3", "the model name came from /v1/models"
    assert result["input_lens"] == [in_len] * n, "usage.prompt_tokens: the server saw the requested lengths"
    assert result["output_lens"] == [out_len] * n and result["total_output_tokens"] == n * out_len
    # one ITL sample per streamed event after the first, and one event per decode step (a token whose
    # text is held back, e.g. split UTF-8, still has its own event, as vLLM sends it)
    assert all(len(itl) == out_len - 1 for itl in result["itls"]), [len(itl) for itl in result["itls"]]
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_tpot_ms"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert_valid_pngs(pngs)


def test_bench_mooncake_replay_hits_the_prefix_cache(up_url, bench_model, tmp_path):
    shared = list(range(4))                        # a 4-block "system prompt" every request repeats
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 512 * 5, "output_length": 3,
                                         "hash_ids": shared + [10 + i]}) + "\n" for i in range(6)))
    result, _ = run_bench(up_url, bench_model, tmp_path, "--dataset-name", "mooncake", "--dataset-path", str(trace),
                          "--mooncake-block-size", "16", "--num-prompts", "6", "--save-detailed", "--no-plots",
                          "--skip-initial-test")
    assert result["completed"] == 6 and result["input_lens"] == [80] * 6
    # the first request is cold; every later one finds at least the shared 64 tokens cached
    assert result["cached_tokens"][0] == 0
    assert all(c >= 48 for c in result["cached_tokens"][1:]), result["cached_tokens"]
    assert result["cached_token_ratio"] >= 0.5 * 5 / 6 * 64 / 80
    assert (result["cold_requests"], result["prefix_hit_requests"]) == (1, 5)


def test_bench_fails_fast_on_a_wrong_model_name(up_url, bench_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kimi_pd", "bench", "--url", up_url, "--tokenizer", str(bench_model),
                           "--model", "no-such-model", "--num-prompts", "2", "--disable-tqdm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "initial test request failed" in proc.stderr and "404" in proc.stderr
    assert httpx.get(up_url + "/health", timeout=5).status_code == 200
