"""Router Prometheus metrics, one registry per app. All names are prefixed `kimi_pd_router_`.

  requests_total{endpoint, decision, outcome}   decision: prefill-decode | decode-only | none;
                                                 outcome: ok | error | cancelled (the client left)
  decisions_total{decision}                      placement decisions
  leg_failures_total{leg, reason}                leg: prefill | decode; reason: connect, timeout, http_5xx, ...
  retries_total{leg}                             a connect failure retried on another worker
  prefill_fallbacks_total{reason}                prefill pool down/failing: decode computed the prompt
                                                 (no_kv_transfer_params: a connector that promises them sent
                                                 none; no_engine_id: a Mooncake bootstrap server did not answer)
  prefill_seconds, transfer_seconds              per leg (transfer as reported by the decode worker; for a
                                                 stock vLLM decode, its vllm:nixl_xfer_time_seconds growth)
  decode_queue_seconds                           decode worker: arrival -> first scheduled (stock vLLM: the
                                                 growth of its vllm:request_queue_time_seconds per health round)
  ttft_seconds, tpot_seconds, e2e_seconds        client-visible latencies
  stream_errors_total                            streams ended with an SSE error event
  migrations_total{outcome}                      decode legs moved to another decode worker (ok | failed)
  prefill_releases_total{outcome}                prefill states released by the router (client gone)
  workers{role, healthy}                         fleet size as this replica sees it
  store_up                                       1 if the state store answered the last refresh
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "kimi_pd_router_"
        self.requests = Counter(p + "requests_total", "Finished requests", ["endpoint", "decision", "outcome"],
                                registry=r)
        self.decisions = Counter(p + "decisions_total", "Placement decisions", ["decision"], registry=r)
        self.leg_failures = Counter(p + "leg_failures_total", "Failed legs", ["leg", "reason"], registry=r)
        self.prefill_fallbacks = Counter(p + "prefill_fallbacks_total", "Prefill legs that fell back to decode-only",
                                         ["reason"], registry=r)
        self.retries = Counter(p + "retries_total", "Legs retried on another worker", ["leg"], registry=r)
        self.prefill_seconds = Histogram(p + "prefill_seconds", "Prefill leg", buckets=_BUCKETS, registry=r)
        self.transfer_seconds = Histogram(p + "transfer_seconds", "State transfer (decode side)", buckets=_BUCKETS,
                                          registry=r)
        self.decode_queue = Histogram(p + "decode_queue_seconds", "Decode worker queue time", buckets=_BUCKETS,
                                      registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token", buckets=_BUCKETS, registry=r)
        self.tpot = Histogram(p + "tpot_seconds", "Time per output chunk after the first", buckets=_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_seconds", "Whole request", buckets=_BUCKETS, registry=r)
        self.migrations = Counter(p + "migrations_total", "Decode legs moved to another decode worker after "
                                  "theirs failed (streams resumed from the delivered tokens; whole answers retried)",
                                  ["outcome"], registry=r)
        self.stream_errors = Counter(p + "stream_errors_total", "Streams ended with an SSE error event", registry=r)
        self.prefill_releases = Counter(p + "prefill_releases_total", "Prefill states released by the router",
                                        ["outcome"], registry=r)
        self.workers = Gauge(p + "workers", "Workers known to this replica", ["role", "healthy"], registry=r)
        self.store_up = Gauge(p + "store_up", "State store reachable", registry=r)
