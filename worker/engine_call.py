"""The engine call every leg makes: one request's outputs from the async engine, observed for metrics.

Built once per worker and handed to each leg at construction, so a leg never imports the module that
dispatched the request to it (worker/legs.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from engine.async_engine import AsyncEngine
from engine.core.inputs import EngineInput, Resume
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.metrics import WorkerMetrics
from worker.role import LegResult


def engine_input(prepared: PreparedPrompt, resume: Resume | None = None) -> EngineInput:
    return EngineInput(prepared.token_ids, prepared.images, resume)


class EngineCall:
    def __init__(self, engine: AsyncEngine, metrics: WorkerMetrics) -> None:
        self.engine, self.metrics = engine, metrics

    async def __call__(self, prepared: PreparedPrompt, params: SamplingParams, result: LegResult, *,
                       imported: ExportedState | None = None, export_state: bool = False,
                       resume: Resume | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs, observed for metrics. `aclosing`: when our consumer stops early, the
        engine stream is closed at once, which aborts the request."""
        stream = self.engine.generate(result.request_id, engine_input(prepared, resume), params, imported=imported,
                                      export_state=export_state, group=result.group)
        async with aclosing(stream) as outputs:
            async for out in outputs:
                yield self.observe(result, out)

    def observe(self, result: LegResult, out: RequestOutput) -> RequestOutput:
        """Per output: cached tokens, queue time (once), TTFT / TPOT, and token counts when it finishes."""
        metrics = self.metrics
        result.num_cached_tokens = out.num_cached_tokens
        now = time.perf_counter()
        last = result.timings.get("last_token_at")
        if out.new_token_ids:
            if last is None:
                metrics.ttft.observe(now - result.timings["start"])
            else:
                metrics.tpot.observe((now - last) / len(out.new_token_ids))
            result.timings["last_token_at"] = now
        if out.finished:
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            metrics.generation_tokens.inc(len(out.output.token_ids))
            metrics.cached_tokens.inc(out.num_cached_tokens)
        if out.queue_seconds is not None and "queue_s" not in result.timings:
            result.timings["queue_s"] = out.queue_seconds
            metrics.queue.observe(out.queue_seconds)
        return out
