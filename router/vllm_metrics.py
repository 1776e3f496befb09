"""Load of a stock vLLM worker, read from its Prometheus `/metrics` on the health-check cadence.

Static vLLM workers register nowhere and publish no heartbeats, so without this the scorer sees
`load: None` for them and prices them by this replica's own sends only. vLLM's v1 engine exports
the same quantities our workers report (`shared.workers.LoadReport`):

  vllm:num_requests_running / vllm:num_requests_waiting   gauges -> running, waiting
  vllm:kv_cache_usage_perc                                 gauge, 0..1 -> cache_usage
  vllm:prefix_cache_queries / _hits                        counters (tokens) -> extra
  vllm:external_prefix_cache_queries / _hits               counters: KV loaded through a connector
  vllm:cache_config_info{num_gpu_blocks, block_size}       -> capacity_tokens
  vllm:request_queue_time_seconds, vllm:nixl_xfer_time_seconds (histograms: _sum, _count) -> extra,
                                                           and the router's decode_queue / transfer histograms

A data-parallel vLLM labels each engine (`engine="0"`, ...): gauges and counters are summed over
them, the cache usage is their mean. Parsed with prometheus_client's text parser.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.capacity import capacity_tokens_from_metrics
from shared.workers import LoadReport

_SUMMED = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
             "vllm:external_prefix_cache_hits", "vllm:request_success", "vllm:prompt_tokens",
             "vllm:generation_tokens")

# histograms whose growth between two scrapes feeds the router's own timing histograms
_HISTOGRAMS = {"vllm:request_queue_time_seconds": "queue", "vllm:nixl_xfer_time_seconds": "transfer"}


def timing_deltas(before: LoadReport | None, after: LoadReport) -> dict[str, tuple[float, int]]:
    """{"queue" | "transfer": (seconds, count)} added between two scrapes of one worker. vLLM's
    histograms are cumulative; their buckets are its own, so the router records the interval's
    mean once per new observation (counts exact, values averaged over one health interval). A
    counter that went down (the worker restarted) gives nothing for that interval."""
    if before is None:
        return {}
    out = {}
    for key in ("queue", "transfer"):
        d_sum = after.extra.get(f"{key}_sum", 0.0) - before.extra.get(f"{key}_sum", 0.0)
        d_count = int(after.extra.get(f"{key}_count", 0) - before.extra.get(f"{key}_count", 0))
        if d_count > 0 and d_sum >= 0:
            out[key] = (d_sum, d_count)
    return out


def load_from_vllm_metrics(text: str, now: float, engine: str | None = None) -> LoadReport | None:
    """A LoadReport from a vLLM /metrics page, or None when the page is not vLLM's (no running gauge);
    `engine`: only that data-parallel rank's samples (`engine="<rank>"`)."""
    if engine is not None:
        text = _only_engine(text, engine)
    sums: dict[str, float] = defaultdict(float)
    usage: list[float] = []
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if not math.isfinite(value):
                continue
            if name in _SUMMED:
                found = True
                sums[_SUMMED[name]] += value
            elif name == "vllm:kv_cache_usage_perc":
                usage.append(value)
            elif name.endswith("_total") and name[:-len("_total")] in _COUNTERS:
                sums["counter:" + name[len("vllm:"):-len("_total")]] += value
    for family in text_string_to_metric_families(text) if found else ():
        key = _HISTOGRAMS.get(family.name)
        if not key:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")) and math.isfinite(sample.value):
                sums["timing:" + key + sample.name[sample.name.rindex("_"):]] += sample.value
    if not found:
        return None
    extra: dict[str, Any] = {key[len("counter:"):]: int(v) for key, v in sums.items() if key.startswith("counter:")}
    extra.update({key[len("timing:"):]: v for key, v in sums.items() if key.startswith("timing:")})
    extra["source"] = "vllm-metrics"
    cache_usage = min(max(sum(usage) / len(usage), 0.0), 1.0) if usage else 0.0
    return LoadReport(running=int(sums["running"]), waiting=int(sums["waiting"]), cache_usage=cache_usage,
                      capacity_tokens=capacity_tokens_from_metrics(text) or 0, ts=now, extra=extra)


def _only_engine(text: str, engine: str) -> str:
    """The page without the samples other data-parallel engines labelled (unlabelled ones stay)."""
    keep = []
    for line in text.splitlines():
        at = line.find('engine="')
        if line.startswith("#") or at < 0 or line.startswith(f'engine="{engine}"', at):
            keep.append(line)
    return "\n".join(keep) + "\n"
