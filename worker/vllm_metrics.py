"""vLLM's metric families for what a worker measures, beside our own `kimi_pd_worker_*` ones.

vLLM's dashboards, alert rules and autoscalers (KEDA, llm-d, Dynamo's planner) read `vllm:*` series
labelled `model_name` (the served model name) and `engine` (the engine index; one engine here, "0").
The names, label names, meanings and histogram buckets are vLLM 0.32's (`vllm/v1/metrics/loggers.py`,
`buckets.py`), so those tools read a kimi-pd worker as they read a vLLM one:

  gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1),
              engine_sleep_state{sleep_state} (always awake), cache_config_info{block_size, num_gpu_blocks, ...}
  counters    prompt_tokens, generation_tokens, prompt_tokens_cached, prompt_tokens_by_source{source},
              prefix_cache_queries / _hits, external_prefix_cache_queries / _hits (a decode worker's pulled
              states), num_preemptions, request_success{finished_reason}
  histograms  time_to_first_token_seconds, inter_token_latency_seconds (one sample per engine step that
              produced tokens, as vLLM), request_time_per_output_token_seconds, e2e_request_latency_seconds,
              request_queue_time_seconds, request_prefill_time_seconds, request_decode_time_seconds,
              request_inference_time_seconds, request_prompt_tokens, request_generation_tokens,
              request_prefill_kv_computed_tokens, request_params_n, request_params_max_tokens,
              request_max_num_generation_tokens (a request with n > 1 reaches the engine as n requests of
              n = 1, so it is counted as n requests)

Not exported, for want of the measurement: iteration_tokens_total (tokens per engine step) and
request_num_preemptions (per-request preemption counts); lora, mm-cache and KV-residency families do
not apply. Times are measured by the worker around the engine call (arrival = when the worker
accepted the request), which is where vLLM's front end measures them too.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM 0.32's bucket families (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's token-count family)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class RequestTimes:
    """One engine request's clock (perf_counter seconds) and counts, for its finished-request samples."""

    start: float
    queue_s: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    prompt_counted: bool = False


class VllmMetrics:
    """The `vllm:*` families, in the worker's registry, with vLLM's labels for one engine."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self._r = registry
        self._seen_preemptions = 0
        self._gauges()
        self._counters()
        self._histograms(request_tokens_buckets(max_model_len))

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge("vllm:" + name, doc, ["model_name", "engine", *extra], registry=self._r)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter("vllm:" + name, doc, ["model_name", "engine", *extra], registry=self._r)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        family = Histogram("vllm:" + name, doc, ["model_name", "engine"], buckets=buckets, registry=self._r)
        return family.labels(**self.labels)

    def _gauges(self) -> None:
        lb = self.labels
        self.running = self._gauge("num_requests_running", "Number of requests in model execution batches.").labels(
            **lb)
        self.waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.").labels(**lb)
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(**lb)
        sleep = self._gauge("engine_sleep_state", "Engine sleep state; awake = 1 means the engine is awake.",
                            ("sleep_state",))
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(**lb, sleep_state=state).set(value)
        self.cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"], registry=self._r)

    def _counters(self) -> None:
        lb = self.labels
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.").labels(**lb)
        self.generation_tokens = self._counter("generation_tokens",
                                               "Number of generation tokens processed.").labels(**lb)
        self.cached_tokens = self._counter("prompt_tokens_cached",
                                           "Number of cached prompt tokens (local + external).").labels(**lb)
        by_source = self._counter("prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.by_source = {s: by_source.labels(**lb, source=s) for s in PROMPT_SOURCES}
        self.cache_queries = self._counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                           "queried tokens.").labels(**lb)
        self.cache_hits = self._counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                        "tokens.").labels(**lb)
        self.external_queries = self._counter("external_prefix_cache_queries", "External prefix cache queries from "
                                              "KV connector, in terms of number of queried tokens.").labels(**lb)
        self.external_hits = self._counter("external_prefix_cache_hits", "External prefix cache hits from KV "
                                           "connector, in terms of number of cached tokens.").labels(**lb)
        self.preemptions = self._counter("num_preemptions", "Cumulative number of preemption from the engine.").labels(
            **lb)
        success = self._counter("request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success = {reason: success.labels(**lb, finished_reason=reason) for reason in FINISHED_REASONS}

    def _histograms(self, tokens: tuple[int, ...]) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = h("request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                       REQUEST_LATENCY_BUCKETS)
        self.inference = h("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.prefill = h("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                         REQUEST_LATENCY_BUCKETS)
        self.decode = h("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                        REQUEST_LATENCY_BUCKETS)
        self.prompt_len = h("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_len = h("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.kv_computed = h("request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during "
                             "prefill (excluding cached tokens).", tokens)
        self.max_generation = h("request_max_num_generation_tokens", "Histogram of maximum number of requested "
                                "generation tokens.", tokens)
        self.params_n = h("request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = h("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   tokens)

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self.cache_info.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                               enable_prefix_caching=str(prefix_caching), engine="0").set(1)

    def sample_engine(self, stats: dict) -> None:
        """Scrape-time gauges, and the engine's cumulative preemption count as a counter."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["cache_usage"])
        preemptions = int(stats.get("preemptions", 0))
        if preemptions > self._seen_preemptions:
            self.preemptions.inc(preemptions - self._seen_preemptions)
        self._seen_preemptions = preemptions

    def prompt_computed(self, prompt_len: int, cached: int, external: int) -> None:
        """Once per engine request, when its first output shows the prompt was computed."""
        local_hit = max(0, cached - external)
        self.prompt_tokens.inc(prompt_len)
        self.cached_tokens.inc(cached)
        self.cache_queries.inc(prompt_len - external)
        self.cache_hits.inc(local_hit)
        if external:
            self.external_queries.inc(prompt_len)
            self.external_hits.inc(external)
        self.by_source["local_compute"].inc(max(0, prompt_len - cached))
        self.by_source["local_cache_hit"].inc(local_hit)
        self.by_source["external_kv_transfer"].inc(external)

    def finished(self, t: RequestTimes, reason: str, prompt_len: int, cached: int, max_tokens: int | None,
                 now: float) -> None:
        """The finished-request samples (vLLM's FinishedRequestStats)."""
        self.success[reason if reason in self.success else "stop"].inc()
        queued = t.queue_s or 0.0
        scheduled = t.start + queued
        first = t.first_token_at if t.first_token_at is not None else now
        last = t.last_token_at if t.last_token_at is not None else now
        decode = max(0.0, last - first)
        self.e2e.observe(max(0.0, now - t.start))
        self.queue.observe(queued)
        self.prefill.observe(max(0.0, first - scheduled))
        self.inference.observe(max(0.0, last - scheduled))
        self.decode.observe(decode)
        self.tpot.observe(decode / (t.generated - 1) if t.generated > 1 else 0.0)
        self.prompt_len.observe(prompt_len)
        self.generation_len.observe(t.generated)
        self.kv_computed.observe(max(0, prompt_len - cached))
        self.params_n.observe(1)                          # n > 1 is fanned out into n requests before the engine
        self.max_generation.observe(t.generated)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
