"""Run a benchmark: sample the workload, send it on schedule, compute, print, save JSON and plots."""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from kimi_pd.bench import metrics as m
from kimi_pd.bench.client import RequestOutput, RequestSettings, send
from kimi_pd.bench.datasets import SampleRequest

DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
               "cached_tokens", "generated_texts", "errors")


@dataclass(frozen=True)
class RunSettings:
    request: RequestSettings
    request_rate: float = math.inf          # requests/s (Poisson at burstiness 1); inf: all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    percentiles: tuple[float, ...] = (99.0,)
    selected_metrics: tuple[str, ...] = m.METRICS
    goodput: tuple[tuple[str, float], ...] = ()
    initial_test: bool = True               # one request first, so a misconfiguration fails fast
    disable_tqdm: bool = False
    request_timeout_s: float = 6 * 3600.0
    metadata: tuple[tuple[str, str], ...] = field(default=())
    num_warmups: int = 0                    # copies of the first request sent (not measured) before the run
    ready_check_s: float = 0.0              # retry the initial test this long while the server starts
    verify_tls: bool = True


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times (s from the start): gamma-distributed gaps with mean 1/rate (Poisson at
    burstiness 1, like vLLM); every request at 0 for an infinite rate."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def _initial_test(client: httpx.AsyncClient, s: RunSettings, first: SampleRequest) -> None:
    """One request first, so a misconfiguration fails fast; retried for `ready_check_s` (a starting
    server), then `num_warmups` copies of it, at most `max_concurrency` at a time, none measured."""
    deadline = time.monotonic() + s.ready_check_s
    while True:
        probe = await send(client, s.request, first)
        if probe.success or time.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)
    if not probe.success:
        raise RuntimeError(f"the initial test request failed ({s.request.url}): {probe.error}")


async def _warm_up(client: httpx.AsyncClient, s: RunSettings, first: SampleRequest) -> None:
    gate = asyncio.Semaphore(s.max_concurrency or max(1, s.num_warmups))

    async def one() -> None:
        async with gate:
            await send(client, s.request, first)
    await asyncio.gather(*(one() for _ in range(s.num_warmups)))


async def run_requests(requests: list[SampleRequest], s: RunSettings) -> tuple[list[RequestOutput], float]:
    """Send `requests` on schedule (their `arrival_s` if every one has it, else the rate); the outputs
    in request order, and the wall time from the first send."""
    timeout = httpx.Timeout(s.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=s.max_concurrency or max(1, len(requests)), max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, verify=s.verify_tls) as client:
        if s.initial_test:
            await _initial_test(client, s, requests[0])
        if s.num_warmups:
            await _warm_up(client, s, requests[0])
        arrivals = [r.arrival_s for r in requests if r.arrival_s is not None]
        if len(arrivals) == len(requests):
            offsets = [float(a) for a in arrivals]
        else:
            offsets = arrival_offsets(len(requests), s.request_rate, s.burstiness, np.random.default_rng(s.seed))
        gate = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        bar = tqdm(total=len(requests), disable=s.disable_tqdm, desc="requests")
        start = time.perf_counter()

        async def one(req: SampleRequest, at: float) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            queued = time.perf_counter()
            if gate is None:
                out = await send(client, s.request, req)
            else:
                async with gate:
                    out = await send(client, s.request, req)
            out.queue_time = out.start_time - queued
            bar.update(1)
            return out

        outputs = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets, strict=False)))
        duration = time.perf_counter() - start
        bar.close()
    return list(outputs), duration


def run_benchmark(requests: list[SampleRequest], s: RunSettings) -> dict[str, Any]:
    """The result dict (vLLM's keys; per-request lists under "detail")."""
    if not requests:
        raise ValueError("no requests to send")
    outputs, duration = asyncio.run(run_requests(requests, s))
    result = m.compute(outputs, duration, s.percentiles, dict(s.goodput), s.selected_metrics)
    return result


def result_json(result: dict[str, Any], s: RunSettings, *, label: str | None, model_id: str, tokenizer_id: str,
                num_prompts: int, dataset: str, detailed: bool) -> dict[str, Any]:
    """vLLM's result file layout: run description, then the metrics (per-request lists only if
    `detailed`, as --save-detailed)."""
    out: dict[str, Any] = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": s.request.backend,
                           "backend": s.request.backend, "label": label, "model_id": model_id,
                           "tokenizer_id": tokenizer_id, "dataset_name": dataset, "num_prompts": num_prompts,
                           **dict(s.metadata),
                           "request_rate": s.request_rate if not math.isinf(s.request_rate) else "inf",
                           "burstiness": s.burstiness, "max_concurrency": s.max_concurrency,
                           "goodput_slos_ms": dict(s.goodput) or None}
    body = {k: v for k, v in result.items() if k != "detail"}
    out.update(body)
    if detailed:
        out.update({k: result["detail"][k] for k in DETAIL_KEYS})
    return out


def result_stem(s: RunSettings, model_id: str, result_dir: Path, filename: str | None) -> Path:
    if filename:
        return result_dir / Path(filename).with_suffix("").name
    rate = "inf" if math.isinf(s.request_rate) else f"{s.request_rate:g}"
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    return result_dir / f"{s.request.backend}-{rate}qps-concurrency{s.max_concurrency}-{Path(model_id).name}-{now}"


def save(out: dict[str, Any], stem: Path, append: bool = False) -> Path:
    """The result JSON; with `append` (vLLM's --append-result) one more JSON document on its own line."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.with_name(stem.name + ".json")
    if append and path.exists() and path.stat().st_size:
        with path.open("a") as f:
            f.write("\n" + json.dumps(out))
    else:
        path.write_text(json.dumps(out, indent=None if append else 1))
    return path


def print_summary(r: dict[str, Any], s: RunSettings) -> None:
    def row(name: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        print("{:<40} {}".format(name, fmt.format(value) if value is not None else "-"))
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", r["completed"], "{:<10}")
    row("Failed requests:", r["failed"], "{:<10}")
    if s.max_concurrency:
        row("Maximum request concurrency:", s.max_concurrency, "{:<10}")
    if not math.isinf(s.request_rate):
        row("Request rate configured (RPS):", s.request_rate)
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", r["total_output_tokens"], "{:<10}")
    row("Cached prompt tokens:", r["total_cached_tokens"], "{:<10}")
    row("Cached token ratio:", r["cached_token_ratio"], "{:<10.3f}")
    row("Cold / prefix-hit requests:", f"{r['cold_requests']} / {r['prefix_hit_requests']}", "{:<10}")
    row("Median TTFT cold / prefix hit (ms):", " / ".join("-" if v is None else f"{v:.2f}" for v in
                                                        (r["median_ttft_cold_ms"], r["median_ttft_prefix_hit_ms"])),
        "{:<10}")
    row("Request throughput (req/s):", r["request_throughput"])
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"])
    row("Peak concurrent requests:", r["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for name in s.selected_metrics:
        short, title = headers[name]
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", r[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", r[f"median_{name}_ms"])
        for p in s.percentiles:
            key = m.percentile_key(p)
            row(f"P{key} {short} (ms):", r[f"p{key}_{name}_ms"])
    print("=" * 50)
    errors = [e for e in r["detail"]["errors"] if e]
    for i, err in enumerate(errors[:10]):
        print(f"error {i}: {err}")
