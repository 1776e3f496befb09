"""The engine call every leg makes: one request's outputs from the async engine, observed for metrics.

Built once per worker and handed to each leg at construction, so a leg never imports the module that
dispatched the request to it (worker/legs.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from engine.async_engine import AsyncEngine
from engine.core.inputs import EngineInput, Resume
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from shared.errors import EngineDead
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.metrics import WorkerMetrics
from worker.role import LegResult
from worker.vllm_metrics import RequestTimes, VllmMetrics


def engine_input(prepared: PreparedPrompt, resume: Resume | None = None) -> EngineInput:
    return EngineInput(prepared.token_ids, prepared.images, resume)


class EngineCall:
    def __init__(self, engine: AsyncEngine, metrics: WorkerMetrics, vllm: VllmMetrics | None = None) -> None:
        self.engine, self.metrics, self.vllm = engine, metrics, vllm

    async def __call__(self, prepared: PreparedPrompt, params: SamplingParams, result: LegResult, *,
                       imported: ExportedState | None = None, export_state: bool = False,
                       resume: Resume | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs, observed for metrics. `aclosing`: when our consumer stops early, the
        engine stream is closed at once, which aborts the request."""
        stream = self.engine.generate(result.request_id, engine_input(prepared, resume), params, imported=imported,
                                      export_state=export_state, group=result.group)
        times = RequestTimes(result.timings["start"])
        external = len(imported.prompt_token_ids) if imported is not None else 0
        finished = False
        try:
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    finished = out.finished
                    self.observe_vllm(times, out, params, external)
                    yield self.observe(result, out)
        except (GeneratorExit, asyncio.CancelledError):        # the consumer left first: vLLM counts an abort
            if not finished:
                self._count_end("abort")
            raise
        except EngineDead:
            self._count_end("error")
            raise

    def _count_end(self, reason: str) -> None:
        if self.vllm is not None:
            self.vllm.success[reason].inc()

    def observe_vllm(self, t: RequestTimes, out: RequestOutput, params: SamplingParams, external: int) -> None:
        """vLLM's samples: TTFT and one ITL per engine step that produced tokens, the prompt's sources once,
        the finished-request histograms at the end."""
        vllm = self.vllm
        if vllm is None:
            return
        now = time.perf_counter()
        if out.queue_seconds is not None and t.queue_s is None:
            t.queue_s = out.queue_seconds
        if out.new_token_ids:
            if t.first_token_at is None:
                t.first_token_at = now
                vllm.ttft.observe(now - t.start)
            else:
                vllm.itl.observe(now - (t.last_token_at or now))
            t.last_token_at = now
            t.generated += len(out.new_token_ids)
            vllm.generation_tokens.inc(len(out.new_token_ids))
        cached = external or out.num_cached_tokens
        if not t.prompt_counted and (out.new_token_ids or out.finished):
            t.prompt_counted = True
            vllm.prompt_computed(len(out.prompt_token_ids), cached, external)
        if out.finished:
            vllm.finished(t, out.output.finish_reason or "stop", len(out.prompt_token_ids), cached,
                          params.max_tokens, now)

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
