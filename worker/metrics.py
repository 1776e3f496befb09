"""Worker Prometheus metrics (one registry per app, so tests and several apps never collide).

Names (all prefixed `kimi_pd_worker_`):
  requests_total{endpoint, outcome}   finished HTTP requests (outcome: ok, client_error, server_error, aborted)
  prompt_tokens_total, generation_tokens_total, cached_prompt_tokens_total
  ttft_seconds, tpot_seconds           time to first token; time per output token after the first
  queue_seconds                        arrival -> first scheduled in the engine
  kv_pull_seconds, kv_pull_failures_total{policy}   decode side: loading a prefill state
  running, waiting, held, cache_usage  engine gauges, sampled at scrape time
  event_loop_lag_seconds               how late a 0.25 s timer ran on the HTTP side (shared/loop_watch.py)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        p, r = "kimi_pd_worker_", self.registry
        self.requests = Counter(p + "requests_total", "Finished requests", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated", registry=r)
        self.cached_tokens = Counter(p + "cached_prompt_tokens_total", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "tpot_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(p + "queue_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self.kv_pull = Histogram(p + "kv_pull_seconds", "Loading a prefill state", buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_pull_failures = Counter(p + "kv_pull_failures_total", "Prefill states that could not be loaded",
                                        ["policy"], registry=r)
        self.running = Gauge(p + "running", "Running requests", registry=r)
        self.waiting = Gauge(p + "waiting", "Waiting requests", registry=r)
        self.held = Gauge(p + "held", "Prefill states held for a decode worker", registry=r)
        self.cache_usage = Gauge(p + "cache_usage", "Fraction of MLA pages in use", registry=r)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "Lateness of a periodic timer: the HTTP side's "
                                  "event loop blocked or starved (e.g. of the GIL by the engine)", registry=r,
                                  buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

    def sample_engine(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.held.set(stats["held"])
        self.cache_usage.set(stats["cache_usage"])
