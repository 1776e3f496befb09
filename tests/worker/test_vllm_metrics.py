"""The worker's `vllm:*` families: vLLM's names, labels and buckets, fed by the engine call as vLLM feeds
its own (one ITL sample per engine step, the prompt's sources once, finished-request samples at the end,
an abort when the consumer leaves)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.outputs import CompletionOutput, RequestOutput
from router.capacity import capacity_tokens_from_metrics
from router.vllm_metrics import load_from_vllm_metrics
from shared.errors import EngineDead
from shared.sampling_params import SamplingParams
from worker.engine_call import EngineCall
from worker.metrics import WorkerMetrics
from worker.role import LegResult
from worker.vllm_metrics import ITL_BUCKETS, TTFT_BUCKETS, VllmMetrics, request_tokens_buckets

PROMPT = [5, 6, 7, 8, 9, 10]
LABELS = {"model_name": "kimi-k3", "engine": "0"}


def _out(new: list[int], so_far: list[int], finished: bool = False, cached: int = 0, reason: str | None = None,
         queue_s: float | None = 0.01) -> RequestOutput:
    completion = CompletionOutput(0, "", list(so_far), [], [], finish_reason=reason)
    return RequestOutput("r", PROMPT, [completion], finished, num_cached_tokens=cached, new_token_ids=list(new),
                         queue_seconds=queue_s)


class FakeEngine:
    """Yields the given engine outputs (one per engine step), or raises after them."""

    def __init__(self, steps: list[RequestOutput], then: BaseException | None = None) -> None:
        self.steps, self.then = steps, then

    async def generate(self, request_id, prompt, params, imported=None, export_state=False, group=None):
        for out in self.steps:
            await asyncio.sleep(0)
            yield out
        if self.then is not None:
            raise self.then


def _call(steps: list[RequestOutput], then: BaseException | None = None, stop_after: int | None = None,
          max_tokens: int = 16) -> dict[str, float]:
    """Run one engine call through EngineCall; the exposition as {sample name + labels: value}."""
    registry = CollectorRegistry()
    vllm = VllmMetrics(registry, "kimi-k3", max_model_len=4096)
    call = EngineCall(FakeEngine(steps, then), WorkerMetrics(registry), vllm)  # type: ignore[arg-type]

    async def consume() -> None:
        gen = call(_Prepared(), SamplingParams(max_tokens=max_tokens), LegResult("r"))
        seen = 0
        try:
            async for _ in gen:
                seen += 1
                if stop_after is not None and seen == stop_after:
                    break
        finally:
            await gen.aclose()

    with contextlib.suppress(EngineDead):
        asyncio.run(consume())
    return _samples(generate_latest(registry).decode())


class _Prepared:
    token_ids, images = PROMPT, []


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_a_streamed_request_gives_vllms_samples():
    steps = [_out([1], [1]), _out([2, 3], [1, 2, 3]), _out([4], [1, 2, 3, 4], finished=True, reason="stop")]
    s = _call(steps)
    assert s["vllm:time_to_first_token_seconds_count"] == 1
    assert s["vllm:inter_token_latency_seconds_count"] == 2             # one per later engine step, not per token
    assert s["vllm:generation_tokens_total"] == 4 == s["kimi_pd_worker_generation_tokens_total"]
    assert s["vllm:prompt_tokens_total"] == 6 == s["kimi_pd_worker_prompt_tokens_total"]
    assert s["vllm:request_success_total{finished_reason=stop}"] == 1
    assert s["vllm:request_success_total{finished_reason=length}"] == 0
    assert s["vllm:e2e_request_latency_seconds_count"] == 1
    assert s["vllm:request_generation_tokens_sum"] == 4
    assert s["vllm:request_prompt_tokens_sum"] == 6
    assert s["vllm:request_params_max_tokens_sum"] == 16
    assert s["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.01)
    assert s["vllm:request_time_per_output_token_seconds_count"] == 1


def test_cached_prompt_tokens_split_by_source():
    s = _call([_out([1], [1], cached=4), _out([2], [1, 2], finished=True, reason="length", cached=4)])
    assert s["vllm:prefix_cache_queries_total"] == 6
    assert s["vllm:prefix_cache_hits_total"] == 4
    assert s["vllm:prompt_tokens_cached_total"] == 4
    assert s["vllm:prompt_tokens_by_source_total{source=local_cache_hit}"] == 4
    assert s["vllm:prompt_tokens_by_source_total{source=local_compute}"] == 2
    assert s["vllm:request_prefill_kv_computed_tokens_sum"] == 2
    assert s["vllm:request_success_total{finished_reason=length}"] == 1


def test_a_consumer_that_leaves_is_an_abort_and_a_dead_engine_an_error():
    s = _call([_out([1], [1]), _out([2], [1, 2]), _out([3], [1, 2, 3], finished=True, reason="stop")], stop_after=1)
    assert s["vllm:request_success_total{finished_reason=abort}"] == 1
    assert s["vllm:request_success_total{finished_reason=stop}"] == 0
    s = _call([_out([1], [1])], then=EngineDead("gone"))
    assert s["vllm:request_success_total{finished_reason=error}"] == 1
    s = _call([_out([1], [1], finished=True, reason="stop")], stop_after=1)    # left after the end: no abort
    assert s["vllm:request_success_total{finished_reason=abort}"] == 0


def test_names_labels_and_buckets_are_vllms():
    registry = CollectorRegistry()
    vllm = VllmMetrics(registry, "kimi-k3", max_model_len=1000)
    vllm.set_cache_config(block_size=16, num_blocks=64, prefix_caching=True)
    vllm.sample_engine({"running": 2, "waiting": 1, "cache_usage": 0.25, "preemptions": 3})
    vllm.sample_engine({"running": 2, "waiting": 1, "cache_usage": 0.25, "preemptions": 5})
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, family in families.items():
        assert name.startswith("vllm:")
        if name != "vllm:cache_config_info":
            assert all({"model_name", "engine"} <= set(s.labels) for s in family.samples), name
            assert all(s.labels["model_name"] == "kimi-k3" for s in family.samples)

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")][:-1]
    assert bounds("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert bounds("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert request_tokens_buckets(4096)[-1] == 2000
    s = _samples(text)
    assert s["vllm:num_preemptions_total"] == 5
    assert s["vllm:engine_sleep_state{sleep_state=awake}"] == 1
    # what the router reads from a stock vLLM worker reads the same from ours
    load = load_from_vllm_metrics(text, 0.0)
    assert load is not None and (load.running, load.waiting, load.cache_usage) == (2, 1, 0.25)
    assert capacity_tokens_from_metrics(text) == 64 * 16
