"""Benchmark outputs -> metrics, with `vllm bench serve`'s definitions and result-JSON keys.

  TTFT  first token chunk - send;  ITL  gaps between token chunks;  E2EL  last chunk - send
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request with more than one output token
  goodput  requests meeting every --goodput SLO (ttft, tpot, e2el in ms) per second
Percentile keys are `p{P}_{metric}_ms` (P printed without ".0"). Added to vLLM's keys:
`total_cached_tokens`, `cached_token_ratio` (prefix-cache hits over prompt tokens, from
`usage.prompt_tokens_details.cached_tokens`), `cold_requests`/`prefix_hit_requests` with their median
TTFTs (no cached token vs some), and the per-second series the plots use.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kimi_pd.bench.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, not {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] < 0:
            raise ValueError(f"--goodput {item!r}: must not be negative")
    return slos


def tpot_of(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize(values: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pP of seconds, in ms (0 for an empty list, as vLLM)."""
    v = np.asarray(values if len(values) else [0.0], dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def per_second(outputs: Sequence[RequestOutput]) -> tuple[list[float], list[int]]:
    """Output tokens and concurrent requests in each 1 s bucket from the first send (vLLM's peak
    throughput series)."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return [], []
    t0 = min(o.start_time for o in ok)
    n = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens, running = np.zeros(n), np.zeros(n, dtype=int)
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            tokens[min(n - 1, int(t - t0))] += 1
        running[int(o.start_time - t0):int(o.start_time + o.latency - t0) + 1] += 1
    return tokens.tolist(), running.tolist()


def compute(outputs: Sequence[RequestOutput], duration_s: float, percentiles: Sequence[float],
            goodput: dict[str, float], selected: Sequence[str] = METRICS) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [t for t in map(tpot_of, ok) if t is not None]
    itls = [gap for o in ok for gap in o.itl]
    e2els = [o.latency for o in ok]
    out_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(out_lens)
    cached = sum(o.cached_tokens for o in ok)
    good = 0
    if goodput:
        for o in ok:
            measured = {"ttft": o.ttft, "tpot": tpot_of(o) or 0.0, "e2el": o.latency}
            good += all(measured[k] <= slo / 1000.0 for k, slo in goodput.items())
    tokens_per_s, running = per_second(outputs)
    result: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "total_cached_tokens": cached, "cached_token_ratio": cached / total_in if total_in else 0.0,
        "max_output_tokens_per_s": max(tokens_per_s, default=0.0),
        "max_concurrent_requests": max(running, default=0),
    }
    # cold prefixes vs prefix-cache hits, as the seed reports them separately
    for name, group in (("cold", [o for o in ok if o.cached_tokens == 0]),
                        ("prefix_hit", [o for o in ok if o.cached_tokens > 0])):
        result[f"{name}_requests"] = len(group)
        result[f"median_ttft_{name}_ms"] = float(np.median([o.ttft for o in group])) * 1e3 if group else None
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected:
        result.update(summarize(values[name], name, percentiles))
    result["detail"] = {
        "input_lens": [o.prompt_len for o in outputs], "output_lens": out_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "queue_times": [o.queue_time for o in outputs], "cached_tokens": [o.cached_tokens for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
        "output_tokens_per_s": tokens_per_s, "concurrent_requests_per_s": running,
    }
    return result
