"""Against vLLM 0.32 itself: the workers' `vllm:*` families use vLLM's names, finish reasons, prompt
sources and bucket bounds; `kimi-pd bench` counts the same stream events, output tokens and ITL samples
as vLLM's own benchmark client on the same streams."""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kimi_pd.bench.client import CHAT, COMPLETIONS, RequestSettings, send
from kimi_pd.bench.datasets import SampleRequest
from tests.e2e.fleet import Fleet
from worker.metrics import WorkerMetrics
from worker.spec_metrics import SpecDecodeMetrics
from worker.vllm_metrics import (
    FINISHED_REASONS,
    ITL_BUCKETS,
    PARAMS_N_BUCKETS,
    PROMPT_SOURCES,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VllmMetrics,
    request_tokens_buckets,
)

pytestmark = pytest.mark.timeout(600)

VLLM_FACTS = r"""
import inspect, json, re
import vllm.v1.metrics.buckets as b, vllm.v1.metrics.loggers as loggers, vllm.v1.spec_decode.metrics as spec
from vllm.v1.engine import FINISH_REASON_STRINGS
from vllm.v1.metrics.stats import PromptTokenStats
names = set(re.findall(r'"(vllm:[a-z0-9_]+)"', inspect.getsource(loggers) + inspect.getsource(spec)))
print(json.dumps({"ttft": b.TIME_TO_FIRST_TOKEN_BUCKETS, "itl": b.INTER_TOKEN_LATENCY_BUCKETS,
                  "latency": b.REQUEST_LATENCY_BUCKETS, "n": b.REQUEST_PARAMS_N_BUCKETS,
                  "tokens": b.histogram_buckets("request_tokens", max_model_len=4096),
                  "reasons": FINISH_REASON_STRINGS, "sources": PromptTokenStats.ALL_SOURCES, "names": sorted(names)}))
"""

VLLM_CLIENT = r"""
import asyncio, json, sys
import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput
url, backend, prompts, out_len = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
async def main():
    async with aiohttp.ClientSession() as session:
        outs = []
        for p in prompts:
            inp = RequestFuncInput(prompt=p, api_url=url, prompt_len=len(p.split()), output_len=out_len,
                                   model="kimi-k3", ignore_eos=True)
            o = await ASYNC_REQUEST_FUNCS[backend](inp, session)
            outs.append({"success": o.success, "itl": len(o.itl), "output_tokens": o.output_tokens,
                         "text": o.generated_text, "error": o.error})
        print(json.dumps(outs))
asyncio.run(main())
"""


def _vllm(python: Path, code: str, *args: str) -> object:
    proc = subprocess.run([str(python), "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_names_reasons_sources_and_buckets_are_vllms(vllm_python):
    facts = _vllm(vllm_python, VLLM_FACTS)
    assert isinstance(facts, dict)
    assert list(TTFT_BUCKETS) == facts["ttft"] and list(ITL_BUCKETS) == facts["itl"]
    assert list(REQUEST_LATENCY_BUCKETS) == facts["latency"] and list(PARAMS_N_BUCKETS) == facts["n"]
    assert list(request_tokens_buckets(4096)) == facts["tokens"]
    assert tuple(FINISHED_REASONS) == tuple(facts["reasons"]) and tuple(PROMPT_SOURCES) == tuple(facts["sources"])
    registry = CollectorRegistry()
    vllm = VllmMetrics(registry, "kimi-k3", 4096)
    SpecDecodeMetrics(registry, 3, vllm.labels)
    ours = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())
            if f.name.startswith("vllm:") and not f.name.endswith("_created")}   # prometheus-client's, in vLLM too
    assert len(ours) >= 30
    assert not ours - set(facts["names"]), f"not vLLM names: {sorted(ours - set(facts['names']))}"
    WorkerMetrics(registry)                                  # and ours sit beside them in one registry


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_counts_events_as_vllms_client(vllm_python, tmp_path, backend):
    prompts, out_len = ["a b c d", "e f g h i j"], 6
    with Fleet(tmp_path, tmp_path) as fleet:
        stub = fleet.stub("both", "stub", "--tokens", "64")
        fleet.wait(stub)
        path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
        theirs = _vllm(vllm_python, VLLM_CLIENT, stub.url + path, backend, json.dumps(prompts), str(out_len))
        settings = RequestSettings(stub.url + path, CHAT if backend == "openai-chat" else COMPLETIONS, "kimi-k3",
                                   ignore_eos=True)

        async def ours_all():
            import httpx
            async with httpx.AsyncClient(timeout=60) as client:
                return [await send(client, settings, SampleRequest(p, len(p.split()), out_len, f"r-{i}"))
                        for i, p in enumerate(prompts)]
        ours = asyncio.run(ours_all())
    assert isinstance(theirs, list)
    for mine, vllm in zip(ours, theirs, strict=True):
        assert vllm["success"] and mine.success, (vllm["error"], mine.error)
        assert (len(mine.itl), mine.output_tokens) == (vllm["itl"], vllm["output_tokens"])
    # chat: the role chunk and the finish chunk are events too (out_len + 2 events, out_len + 1 gaps)
    assert theirs[0]["itl"] == out_len + (1 if backend == "openai-chat" else -1)
