"""The worker HTTP service: OpenAI endpoints (so a worker can serve alone), /health, /metrics, admin.

Composition only: request parsing, prompt preparation, the P/D legs and response shaping live in
their own modules. Every error leaves through one mapping (shared.openai.errors), as an OpenAI error
body, or, once a stream has started, as an SSE `error` event followed by [DONE].
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.core.inputs import Resume
from shared.errors import InvalidRequest
from shared.http import install_error_handlers, read_json_body, read_json_object, until_disconnect
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.openai.convert import to_sampling_params
from shared.openai.errors import ModelNotFound, OpenAIError, error_from_exception
from shared.openai.fanout import fan_out, needs_fan_out
from shared.openai.helpers import check_admin, install_helpers
from shared.openai.ids import GROUP_HEADER, LEASE_RENEW_HEADER, header_request_id
from shared.openai.prompts import prepare_chat, prepare_completion
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.sse import SSE_DONE, sse_error
from worker import responses
from worker.flags import AUTO_TOOL_CHOICE_ERROR
from worker.helpers import WorkerHelpers
from worker.legs import new_request_id, run_leg
from worker.role import LegResult
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def create_app(runtime: WorkerRuntime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        yield
        await runtime.stop()

    app = FastAPI(title=f"kimi-pd {runtime.role.name} worker", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.runtime = runtime
    app.state.helpers = WorkerHelpers(runtime)          # /v1/models, /tokenize, ... (shared routes)
    install_error_handlers(app, _count_error)
    install_helpers(app)
    app.add_api_route("/v1/chat/completions", _chat, methods=["POST"])
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/admin/drain", _drain, methods=["POST"])
    for path, kind, handle in runtime.role.routes(runtime.settings.transfer_secret):
        app.add_api_route(path, _leg_route(kind, handle), methods=["POST"])
    return app


_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


def _count_error(request: Request, status: int) -> None:
    endpoint = _ENDPOINTS.get(request.url.path)       # the same labels as successful requests; never a raw path
    if endpoint is not None:
        outcome = "aborted" if status == 499 else ("client_error" if status < 500 else "server_error")
        _rt(request).metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()


def _rt(request: Request) -> WorkerRuntime:
    return request.app.state.runtime


def _check_api_key(request: Request) -> None:
    request.app.state.helpers.check_client(request)


def _check_model(rt: WorkerRuntime, model: str | None) -> str:
    served = rt.settings.served_model_name
    if model not in (None, served):
        raise ModelNotFound(model)
    return served


async def _validated_then_fanned_out(request: Request, model_cls, one) -> Response:
    """Parse the body as `model_cls`; several choices (n, best_of, prompt lists) become sub-requests."""
    _check_api_key(request)
    req = model_cls.model_validate(await read_json_body(request, _rt(request).settings.max_request_bytes))
    if needs_fan_out(req):
        request.state.kimi_pd_group = new_request_id("group", None)    # one share of the batch for all
        return await fan_out(req, lambda sub: one(request, sub))
    return await one(request, req)


async def _chat(request: Request) -> Response:
    return await _validated_then_fanned_out(request, ChatCompletionRequest, _chat_one)


async def _chat_one(request: Request, req: ChatCompletionRequest) -> Response:
    rt = _rt(request)
    model = _check_model(rt, req.model)
    if req.tools and req.tool_choice in (None, "auto") and not rt.settings.enable_auto_tool_choice:
        raise InvalidRequest(AUTO_TOOL_CHOICE_ERROR, param="tool_choice")      # vLLM's gate and words
    params = to_sampling_params(req, vocab_size=rt.model_config.text_config.vocab_size)
    prepared = await asyncio.to_thread(prepare_chat, req, rt.tokenizer, rt.model_config.vision_config,
                                       rt.settings.surface)
    return await _serve(request, rt, "chat", req, params, prepared,
                        lambda outs, result: responses.chat_stream(req, model, prepared, outs, result, rt.tokenizer),
                        lambda out, result: responses.chat_completion(req, model, prepared, out, result, rt.tokenizer))


async def _completions(request: Request) -> Response:
    return await _validated_then_fanned_out(request, CompletionRequest, _completion_one)


async def _completion_one(request: Request, req: CompletionRequest) -> Response:
    rt = _rt(request)
    model = _check_model(rt, req.model)
    params = to_sampling_params(req, vocab_size=rt.model_config.text_config.vocab_size)
    prepared = prepare_completion(req, rt.tokenizer)
    return await _serve(request, rt, "completions", req, params, prepared,
                        lambda outs, result: responses.completion_stream(req, model, outs, result, rt.tokenizer),
                        lambda out, result: responses.completion(req, model, out, result, rt.tokenizer))


async def _serve(request: Request, rt: WorkerRuntime, endpoint: str, req, params, prepared,
                 stream_fn: Callable, whole_fn: Callable) -> Response:
    client_id = req.request_id or header_request_id(request.headers.get("x-request-id"))
    result = LegResult(new_request_id(endpoint, client_id), group=_group(request),
                       lease_renewed=request.headers.get(LEASE_RENEW_HEADER) == "1")
    ktp = KVTransferParams.parse(req.kv_transfer_params)
    spec = req.kimi_pd_resume
    resume = Resume(list(spec.token_ids), spec.seed_offset) if spec is not None else None
    outputs = run_leg(rt, prepared, params, ktp, result, resume)
    streaming = req.stream and rt.streams(ktp)
    if streaming:
        # errors before the first token are plain 4xx/5xx; a client gone by then cancels the request
        first = await until_disconnect(request, _first_or_error(outputs))
        return StreamingResponse(_guarded_stream(rt, endpoint, stream_fn(_prepend(first, outputs), result)),
                                 media_type="text/event-stream", headers=_leg_headers(result))
    final = await _until_done_or_disconnect(request, outputs)
    rt.metrics.requests.labels(endpoint=endpoint, outcome="ok").inc()
    return JSONResponse(whole_fn(final, result).model_dump(mode="json", exclude_none=True),
                        headers=_leg_headers(result))


def _group(request: Request) -> str | None:
    """The fan-out this request is one sequence of: ours, or the router's (`x-kimi-pd-group`)."""
    return getattr(request.state, "kimi_pd_group", None) or header_request_id(request.headers.get(GROUP_HEADER))


def _leg_headers(result: LegResult) -> dict[str, str]:
    headers = {"x-request-id": result.request_id}
    if "kv_pull_s" in result.timings:
        headers["x-kv-pull-seconds"] = f"{result.timings['kv_pull_s']:.6f}"
    if result.recomputed:
        headers["x-kv-recomputed"] = "1"
    if "queue_s" in result.timings:
        headers["x-queue-seconds"] = f"{result.timings['queue_s']:.6f}"
    return headers


async def _first_or_error(outputs: AsyncIterator) -> Any:
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        raise OpenAIError("the request ended without output") from None


async def _prepend(first: Any, rest: AsyncGenerator) -> AsyncGenerator:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def _guarded_stream(rt: WorkerRuntime, endpoint: str, chunks: AsyncGenerator[bytes, None]
                         ) -> AsyncGenerator[bytes, None]:
    """Relay chunks; a failure after the stream started becomes an SSE error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
        rt.metrics.requests.labels(endpoint=endpoint, outcome="ok").inc()
    except (asyncio.CancelledError, GeneratorExit):
        rt.metrics.requests.labels(endpoint=endpoint, outcome="aborted").inc()
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the client in-band
        status, body = error_from_exception(exc)
        rt.metrics.requests.labels(endpoint=endpoint, outcome="server_error").inc()
        detail = body.error
        yield sse_error(status, detail.message, detail.type, cast(str | None, detail.code))   # ours: never an int
        yield SSE_DONE
    finally:
        await chunks.aclose()


async def _until_done_or_disconnect(request: Request, outputs: AsyncGenerator) -> Any:
    """Run to the final output; if the client goes away first, stop (the engine request is aborted)."""
    async def consume():
        last = None
        try:
            async for out in outputs:
                last = out
        finally:
            await outputs.aclose()
        return last

    return await until_disconnect(request, consume())


async def _health(request: Request) -> JSONResponse:
    rt = _rt(request)
    stats = rt.engine.stats()
    status = 503 if stats["dead"] else 200
    return JSONResponse({"status": "dead" if stats["dead"] else ("draining" if rt.draining else "ok"),
                         "role": rt.role.name, "worker_id": rt.settings.worker_id, **stats}, status_code=status)


async def _metrics(request: Request) -> Response:
    rt = _rt(request)
    stats = rt.engine.stats()
    rt.metrics.sample_engine(stats)
    rt.vllm_metrics.sample_engine(stats)
    spec_stats = rt.engine.engine.spec_stats
    if rt.spec_metrics is not None and spec_stats is not None:
        rt.spec_metrics.observe(spec_stats.drain())
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _check_admin(request: Request) -> None:
    check_admin(request, _rt(request).settings.admin_token, "admin and internal endpoints need the admin token")


def _leg_route(kind: LegKind, handle: Callable) -> Callable:
    """An internal route a leg adds (e.g. the prefill's `/internal/kv/release`): admin token, JSON object."""
    async def route(request: Request) -> JSONResponse:
        _check_admin(request)
        rt = _rt(request)
        body = await read_json_object(request, rt.settings.max_request_bytes)
        return JSONResponse(await handle(rt.legs[kind], body))
    return route


async def _drain(request: Request) -> JSONResponse:
    """Stop taking new work (routers see `draining` in the next load report); authenticated."""
    _check_admin(request)
    rt = _rt(request)
    rt.draining = True
    if rt.presence:
        rt.presence.draining = True
    return JSONResponse({"draining": True, **rt.engine.stats()})
