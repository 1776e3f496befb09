"""One request through the engine, honouring vLLM's P/D protocol (`kv_transfer_params`).

- `do_remote_decode` (prefill leg): compute the prompt, stop after the first token, publish the
  state under a lease, answer with the parameters a decode worker needs.
- `do_remote_prefill` (decode leg): pull the state, release the lease, continue from it. If it
  cannot be pulled, `kv_load_failure_policy` decides: `recompute` locally or fail with 503.
- neither: an ordinary colocated request.
"""
from __future__ import annotations

import itertools
import time
from contextlib import aclosing
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from decode_worker.pull import KVLoadFailed
from engine.core.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from shared.openai.errors import BadRequest, ServiceUnavailable
from shared.serving.prompts import PreparedPrompt
from shared.serving.runtime import WorkerRuntime

_ids = itertools.count()


@dataclass
class LegResult:
    """What the HTTP layer needs besides the outputs."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    recomputed: bool = False
    timings: dict[str, float] = field(default_factory=lambda: {"start": time.perf_counter()})


def leg_kind(kv_transfer_params: dict[str, Any] | None) -> str:
    ktp = kv_transfer_params or {}
    if ktp.get("do_remote_decode"):
        return "prefill"
    if ktp.get("do_remote_prefill"):
        return "decode"
    return "local"


async def run_leg(rt: WorkerRuntime, prepared: PreparedPrompt, params: SamplingParams,
                  kv_transfer_params: dict[str, Any] | None, result: LegResult) -> AsyncIterator[RequestOutput]:
    """Yield engine outputs for this request; fills `result` (transfer params, cached tokens)."""
    kind = leg_kind(kv_transfer_params)
    if kind == "prefill":
        async with aclosing(_prefill_leg(rt, prepared, params, result)) as outputs:
            async for out in outputs:
                yield out
        return
    imported = None
    if kind == "decode":
        imported = await _pull(rt, prepared, kv_transfer_params, result)
    # aclosing: when our consumer stops early, the engine stream is closed at once, which aborts it
    stream = rt.engine.generate(result.request_id, prepared.engine_input(), params, imported=imported)
    async with aclosing(stream) as outputs:
        async for out in outputs:
            yield _observe(rt, result, out)


def _observe(rt: WorkerRuntime, result: LegResult, out: RequestOutput) -> RequestOutput:
    """Per output: cached tokens, queue time (once), TTFT / TPOT, and token counts when it finishes."""
    result.num_cached_tokens = out.num_cached_tokens
    now = time.perf_counter()
    last = result.timings.get("last_token_at")
    if out.new_token_ids:
        if last is None:
            rt.metrics.ttft.observe(now - result.timings["start"])
        else:
            rt.metrics.tpot.observe((now - last) / len(out.new_token_ids))
        result.timings["last_token_at"] = now
    if out.finished:
        rt.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        rt.metrics.generation_tokens.inc(len(out.output.token_ids))
        rt.metrics.cached_tokens.inc(out.num_cached_tokens)
    if out.queue_seconds is not None and "queue_s" not in result.timings:
        result.timings["queue_s"] = out.queue_seconds
        rt.metrics.queue.observe(out.queue_seconds)
    return out


async def _prefill_leg(rt: WorkerRuntime, prepared: PreparedPrompt, params: SamplingParams,
                       result: LegResult) -> AsyncIterator[RequestOutput]:
    if rt.handoff is None:
        raise BadRequest("this worker does not serve prefill legs (role: %s)" % rt.settings.role,
                         param="kv_transfer_params")
    final = None
    async with aclosing(rt.engine.generate(result.request_id, prepared.engine_input(), params,
                                           export_state=True)) as outputs:
        async for out in outputs:
            final = _observe(rt, result, out)
    start = time.perf_counter()
    params_out = await rt.handoff.publish(result.request_id)
    result.timings["publish_s"] = time.perf_counter() - start
    result.kv_transfer_params = params_out.to_dict()
    result.num_cached_tokens = final.num_cached_tokens
    yield final


async def _pull(rt: WorkerRuntime, prepared: PreparedPrompt, ktp: dict[str, Any], result: LegResult):
    if rt.puller is None:
        raise BadRequest("this worker does not serve decode legs (role: %s)" % rt.settings.role,
                         param="kv_transfer_params")
    try:
        pulled = await rt.puller.pull(ktp, prepared.token_ids)
    except KVLoadFailed as exc:
        rt.metrics.kv_pull_failures.labels(policy="fail").inc()
        raise ServiceUnavailable(str(exc), code="kv_load_failed") from exc
    rt.metrics.kv_pull.observe(pulled.seconds)
    result.timings["kv_pull_s"] = pulled.seconds
    if pulled.state is None:
        rt.metrics.kv_pull_failures.labels(policy="recompute").inc()
        result.recomputed = True
        return None
    return pulled.state


def new_request_id(prefix: str, client_id: str | None) -> str:
    """Client ids are kept for tracing but made unique, so a retried id never collides."""
    return f"{prefix}-{client_id or ''}-{next(_ids)}-{time.monotonic_ns() % 10**9}"
