"""Router Prometheus metrics, one registry per app. All names are prefixed `kimi_pd_router_`.

  requests_total{endpoint, decision, outcome}   decision: prefill-decode | decode-only | none;
                                                 outcome: ok | error | cancelled (the client left)
  decisions_total{decision}                      placement decisions
  decision_reasons_total{decision, reason}       ... and why (router/placement/transfer.py Reason)
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
  recomputes_total{outcome}                      vLLM-Ascend recomputed hand-backs run again (rerun | failed)
  prefill_releases_total{outcome}                prefill states released by the router (client gone)
  workers{role, healthy}                         fleet size as this replica sees it
  store_up                                       1 if the state store answered the last refresh
  placement_tail_prefill_seconds                 the recent prefill legs' tail of uncached seconds
                                                 (WorkLedger.tail_prefill_s): the backlog filter lets a prefix
                                                 holder be its tail_share x this behind; NaN until known
  placement_kv_pool_blocks                       blocks the router believes the prefill workers' KV pool holds
                                                 (--kv-pool-blocks; 0 without a pool)
  event_loop_lag_seconds                         how late a 0.25 s timer ran (shared/loop_watch.py): a blocked
                                                 or starved process; stalls of 1 s or more are also logged
  tenant_requests_total{tenant, outcome}         admission (docs/admission.md): finished requests per tenant
  tenant_tokens_total{tenant, kind}              prompt | completion tokens per tenant
  tenant_rejections_total{tenant, reason}        rate_limited | queue_full | queue_timeout
  tenant_request_seconds{tenant}                 admitted request time per tenant (queue wait included)
  admission_queue_depth, admission_inflight      requests waiting for a slot / holding one on this replica
  admission_queue_wait_seconds                   time a request waited for its slot
  admission_queue_rejections_total{reason}       queue_full | queue_timeout
  ratelimit_local                                1 while the store is unreachable: local limits of 1/N each
  ratelimit_store_seconds                        one rate-limit round trip to the store (cost per request)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CachedLabels:
    """A labelled counter whose children are kept in a dict: prometheus-client's `labels()` takes a
    lock and re-validates the names on every call, several times per request on the hot path.
    Label values here come from small fixed sets, so the dict stays small."""

    def __init__(self, metric: Counter) -> None:
        self.metric = metric
        self._children: dict[tuple[tuple[str, str], ...], Counter] = {}

    def labels(self, **values: str) -> Counter:
        key = tuple(values.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metric.labels(**values)
        return child

    def __getattr__(self, name: str):
        return getattr(self.metric, name)


ENDPOINTS = ("chat", "completions")
DECISIONS = ("prefill-decode", "decode-only", "none")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "kimi_pd_router_"

        def counter(name: str, doc: str, labels: list[str]) -> CachedLabels:
            return CachedLabels(Counter(p + name, doc, labels, registry=r))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(p + name, doc, buckets=_BUCKETS, registry=r)

        self.requests = counter("requests_total", "Finished requests", ["endpoint", "decision", "outcome"])
        # every series a request can land in exists from the start at 0: a counter whose first sample is
        # already 1 hides that increment from rate(), so the error-ratio alert would read NaN after a burst
        for endpoint in ENDPOINTS:
            for decision in DECISIONS:
                for outcome in ("ok", "error"):
                    self.requests.labels(endpoint=endpoint, decision=decision, outcome=outcome)
        self.decisions = counter("decisions_total", "Placement decisions", ["decision"])
        self.decision_reasons = counter("decision_reasons_total", "Placement decisions by why they were made",
                                        ["decision", "reason"])
        self.leg_failures = counter("leg_failures_total", "Failed legs", ["leg", "reason"])
        self.prefill_fallbacks = counter("prefill_fallbacks_total", "Prefill legs that fell back to decode-only",
                                         ["reason"])
        self.retries = counter("retries_total", "Legs retried on another worker", ["leg"])
        self.prefill_seconds = histogram("prefill_seconds", "Prefill leg")
        self.transfer_seconds = histogram("transfer_seconds", "State transfer (decode side)")
        self.decode_queue = histogram("decode_queue_seconds", "Decode worker queue time")
        self.ttft = histogram("ttft_seconds", "Time to first token")
        self.tpot = histogram("tpot_seconds", "Time per output chunk after the first")
        self.e2e = histogram("e2e_seconds", "Whole request")
        self.migrations = counter("migrations_total", "Decode legs moved to another decode worker after theirs "
                                  "failed (streams resumed from the delivered tokens; whole answers retried)",
                                  ["outcome"])
        self.recomputes = counter("recomputes_total", "Requests a vLLM-Ascend decode gave back (stop_reason "
                                  "recomputed), run again from a prefill", ["outcome"])
        self.stream_errors = Counter(p + "stream_errors_total", "Streams ended with an SSE error event", registry=r)
        self.prefill_releases = counter("prefill_releases_total", "Prefill states released by the router", ["outcome"])
        # gauge modes matter only under `--workers N` (prometheus_client's multiprocess mode): what every
        # process sees alike is the latest of the live processes; what each holds of its own is summed
        self.workers = Gauge(p + "workers", "Workers known to this replica", ["role", "healthy"], registry=r,
                             multiprocess_mode="livemostrecent")
        self.store_up = Gauge(p + "store_up", "State store reachable", registry=r, multiprocess_mode="livemostrecent")
        self.tail_prefill = Gauge(p + "placement_tail_prefill_seconds", "High quantile of the recent prefill legs' "
                                  "uncached seconds, which bounds a prefix holder's wait (NaN until known)",
                                  registry=r, multiprocess_mode="livemostrecent")
        self.kv_pool_blocks = Gauge(p + "placement_kv_pool_blocks", "Blocks this router believes the prefill "
                                    "workers' KV pool holds (what it sent them, up to --kv-pool-blocks)",
                                    registry=r, multiprocess_mode="livemostrecent")
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "Lateness of a periodic timer: the event loop "
                                  "blocked or starved of CPU", registry=r,
                                  buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self._admission(counter, r)

    def _admission(self, counter, r: CollectorRegistry) -> None:
        p = "kimi_pd_router_"
        self.tenant_requests = counter("tenant_requests_total", "Finished requests per tenant", ["tenant", "outcome"])
        self.tenant_tokens = counter("tenant_tokens_total", "Tokens per tenant", ["tenant", "kind"])
        self.tenant_rejections = counter("tenant_rejections_total", "Requests refused by admission control",
                                         ["tenant", "reason"])
        self.tenant_seconds = Histogram(p + "tenant_request_seconds", "Admitted request time per tenant",
                                        ["tenant"], buckets=_BUCKETS, registry=r)
        self.queue_depth = Gauge(p + "admission_queue_depth", "Requests waiting for a slot", registry=r,
                                 multiprocess_mode="livesum")
        self.inflight = Gauge(p + "admission_inflight", "Requests holding a slot", registry=r,
                              multiprocess_mode="livesum")
        self.queue_wait = Histogram(p + "admission_queue_wait_seconds", "Wait for a slot", buckets=_BUCKETS,
                                    registry=r)
        self.queue_rejections = counter("admission_queue_rejections_total", "Requests the queue refused", ["reason"])
        self.ratelimit_local = Gauge(p + "ratelimit_local", "1: the store is unreachable, limits are local (1/N)",
                                     registry=r, multiprocess_mode="livemax")
        self.ratelimit_store_seconds = Histogram(p + "ratelimit_store_seconds", "Rate-limit round trip to the store",
                                                 buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25),
                                                 registry=r)
