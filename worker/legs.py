"""One request through the engine, honouring vLLM's P/D protocol (`kv_transfer_params`).

The params' leg picks who serves it: `prefill` and `decode` go to the role's leg of that kind (a
role without it answers 400), `local` (no params) is an ordinary colocated request, served here.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.core.inputs import EngineInput
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from shared.kv_transfer_params import KVTransferParams
from shared.openai.errors import BadRequest
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.role import LegResult
from worker.runtime import WorkerRuntime

_ids = itertools.count()


def engine_input(prepared: PreparedPrompt) -> EngineInput:
    return EngineInput(prepared.token_ids, prepared.images)


async def run_leg(rt: WorkerRuntime, prepared: PreparedPrompt, params: SamplingParams,
                  ktp: KVTransferParams | None, result: LegResult) -> AsyncIterator[RequestOutput]:
    """Yield engine outputs for this request; fills `result` (transfer params, cached tokens)."""
    kind = ktp.leg if ktp is not None else "local"
    if kind == "local":
        stream = generate(rt, prepared, params, result)
    else:
        leg = rt.legs.get(kind)
        if leg is None:
            raise BadRequest(f"this worker does not serve {kind} legs (role: {rt.role.name})",
                             param="kv_transfer_params")
        stream = leg.run(prepared, params, ktp, result)
    async with aclosing(stream) as outputs:
        async for out in outputs:
            yield out


async def generate(rt: WorkerRuntime, prepared: PreparedPrompt, params: SamplingParams, result: LegResult, *,
                   imported: ExportedState | None = None, export_state: bool = False) -> AsyncIterator[RequestOutput]:
    """The engine's outputs, observed for metrics. `aclosing`: when our consumer stops early, the
    engine stream is closed at once, which aborts the request."""
    stream = rt.engine.generate(result.request_id, engine_input(prepared), params, imported=imported,
                                export_state=export_state)
    async with aclosing(stream) as outputs:
        async for out in outputs:
            yield observe(rt, result, out)


def observe(rt: WorkerRuntime, result: LegResult, out: RequestOutput) -> RequestOutput:
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


def new_request_id(prefix: str, client_id: str | None) -> str:
    """Client ids are kept for tracing but made unique, so a retried id never collides."""
    return f"{prefix}-{client_id or ''}-{next(_ids)}-{time.monotonic_ns() % 10**9}"
