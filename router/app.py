"""The router service: OpenAI endpoints in front of the P/D fleet, /health, /ready, /metrics, admin, /dashboard.

Clients created once in the lifespan (router.transport.worker_http for the request path, httpx for health and admin
calls, the store, background loops) and kept on app.state; routes only compose them. The two
OpenAI POST endpoints are served through `router.transport.fast_path` (past FastAPI's routing layers).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import secrets
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, cast

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import health_checker
from router.admission import http as admission_http
from router.admission.tenants import Tenant, Tenants
from router.connectors import ALIASES as CONNECTOR_ALIASES
from router.connectors import CONNECTORS
from router.dashboard import install as install_dashboard
from router.helpers import RouterHelpers
from router.kv_events_relay import KVEventsRelay
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.placement.pipeline import build_pipeline
from router.procs.metrics import MergedMetrics, scrape_registry
from router.procs.share import ProcessShare
from router.prompt_source import load_prompt_source
from router.registry import WorkerRegistry
from router.request.trace import Trace
from router.sampling_check import SamplingCheck
from router.settings import RouterSettings
from router.transport.fast_path import EventStreamResponse, FastPathApp
from router.transport.upstream import UpstreamError, make_session
from shared.http import (
    ClientDisconnected,
    header,
    install_error_handlers,
    parse_json,
    read_body,
    read_json_object,
    until_disconnect,
)
from shared.loop_watch import watch_loop
from shared.openai.errors import BadRequest, OpenAIError, error_response
from shared.openai.fanout import AnyRequest, R, fan_out, needs_fan_out
from shared.openai.helpers import check_admin, check_model, install_helpers
from shared.openai.ids import header_request_id
from shared.openai.prompts import fetches_images
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.store.factory import make_store

log = logging.getLogger(__name__)
RunOne = Callable[[AnyRequest], Awaitable[Response]]     # fan-out hands each endpoint its own request type
_ids = itertools.count()
_INSTANCE = secrets.token_hex(4)               # router replicas never mint the same internal id


def create_app(settings: RouterSettings, share: ProcessShare | None = None) -> FastPathApp:
    """`share`: this is one of `--workers N` router processes (router/procs/), placing as one router with
    its siblings through the shared table."""
    settings.validate()
    tenants = Tenants(settings.tenants_file, settings.api_keys)      # a bad tenants file stops start-up here
    settings = _with_tenant_keys(settings, tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = asyncio.Event()
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=100, max_keepalive_connections=20))
        session = make_session()                     # the request path: httptools parser, pooled
        store = make_store(settings.store_url, settings.namespace) if settings.store_url else None
        registry = WorkerRegistry(settings, store)
        metrics = RouterMetrics()
        pipeline = build_pipeline(**settings.pipeline_spec())
        app.state.settings, app.state.registry, app.state.metrics = settings, registry, metrics
        app.state.share, app.state.workers_shown = share, set()
        if share is not None:
            share.attach(registry)
        app.state.prompts = prompts = load_prompt_source(settings.model, settings.surface)
        app.state.tenants = tenants
        app.state.helpers = RouterHelpers(settings, prompts, tenants)     # /v1/models, /tokenize, ... (shared routes)
        app.state.admission = admission_http.build(app.state, store, _spawn)
        app.state.sampling_check = SamplingCheck()
        log.info("prompt hashing: %s (%s)", prompts.kind, settings.model or "no tokenizer")
        app.state.orchestrator = Orchestrator(settings, registry, client, pipeline, metrics, settings.admin_token,
                                              session)
        await _first_round(settings, registry, metrics, client, session, store)
        tasks = _loops(app.state, client, stop)
        if settings.kv_events:                   # stock vLLM's ZMQ KV events -> the exact prefix index
            app.state.kv_events = relay = KVEventsRelay(settings.kv_events, registry.index.exact,
                                                        registry.index.exact_workers, registry.hash_chain)
            tasks.append(asyncio.create_task(relay.run(stop)))
        log.info("router on %s:%d (%d static workers, store %s)", settings.host, settings.port,
                 len(registry.static), "yes" if store else "no")
        yield
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        await session.close()
        if store is not None:
            await store.close()

    # no /docs, /redoc, /openapi.json: the API is OpenAI's, and a gateway should not describe itself
    app = FastPathApp(title="kimi-pd router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_exception_handler(UpstreamError, _upstream_error)
    install_helpers(app)
    for path, fn, methods in (("/v1/chat/completions", _chat, ["POST"]),
                              ("/v1/completions", _completions, ["POST"]), ("/health", _health, ["GET"]),
                              ("/ready", _ready, ["GET"]), ("/metrics", _metrics, ["GET"]),
                              ("/admin/workers", _list_workers, ["GET"]), ("/admin/workers", _add_worker, ["POST"]),
                              ("/admin/workers/{worker_id:path}/drain", _drain_worker, ["POST"])):
        app.add_api_route(path, fn, methods=methods)
    # /dashboard (page) and /dashboard/state (admin token)
    install_dashboard(app, _check_admin, _ready_state)
    admission_http.install(app, _check_admin)        # 429/503 with their headers, /admin/tenants
    app.fast_routes = {"/v1/chat/completions": _chat, "/v1/completions": _completions}
    return app


def _loops(st: Any, client: httpx.AsyncClient, stop: asyncio.Event) -> list[asyncio.Task]:
    """The loops beside the requests: store refresh, rate-limit heartbeat, queue pump, the stall watch, health
    rounds and, under `--workers N`, following the sibling processes (process 0 alone probes; the others apply
    its rounds)."""
    settings, registry, admission, share = st.settings, st.registry, st.admission, st.share
    tasks = [asyncio.create_task(registry.run(stop)), asyncio.create_task(admission.limiter.run(stop)),
             asyncio.create_task(admission_http.pump_loop(admission, stop, 0.25 if share is None else 0.1)),
             asyncio.create_task(watch_loop(stop, st.metrics.loop_lag.observe,
                                            "router" if share is None else f"router process {share.index}"))]
    if share is None or share.is_leader:
        tasks.append(asyncio.create_task(health_checker.run(
            client, registry, settings.health_check_s, stop, st.metrics, settings.health_timeout_s,
            None if share is None else share.health_round)))
    if share is not None:
        st.merged_metrics = MergedMetrics(st.metrics)
        admission.accounting.siblings = share.sibling_usage
        tasks.append(asyncio.create_task(share.run(stop, admission.accounting.raw)))
        share.ready()
    return tasks


async def _first_round(settings: RouterSettings, registry: WorkerRegistry, metrics: RouterMetrics,
                       client: httpx.AsyncClient, session: Any, store: Any) -> None:
    """The fleet before the first request: the store read and one health round. Static workers declared
    ours that answer as stock vLLM stop the start-up: the operator must name their --kv-connector."""
    await registry.refresh()
    await health_checker.check_once(client, registry, settings.connect_timeout_s, metrics)
    refused = registry.refused()
    if refused:
        await client.aclose()
        await session.close()
        if store is not None:
            await store.close()
        raise RuntimeError(refused)


async def _upstream_error(request: Request, exc: Exception) -> JSONResponse:
    """A worker's own OpenAI error passes through unchanged; transport failures become 502/503/504."""
    assert isinstance(exc, UpstreamError)          # registered for UpstreamError only
    if exc.body is not None:
        return JSONResponse(exc.body, status_code=exc.status)
    body = error_response(exc.status, exc.message, code=exc.reason)
    return JSONResponse(body.model_dump(mode="json"), status_code=exc.status)


def _with_tenant_keys(settings: RouterSettings, tenants: Tenants) -> RouterSettings:
    """Keys in the tenants file are client keys too: workers need authenticated calls, and answers do
    not name internal workers unless asked to."""
    if not tenants.keys_required or settings.api_keys:
        return settings
    if not (settings.admin_token or settings.worker_api_key):
        raise ValueError("the tenants file holds API keys, so calls to workers must be authenticated too: set "
                         "KIMI_PD_ADMIN_TOKEN (or KIMI_PD_WORKER_API_KEY)")
    return settings if settings.placement_headers is not None else replace(settings, placement_headers=False)


_background: set[asyncio.Task] = set()


def _spawn(work: Awaitable) -> None:
    """Run `work` after the answer (settling a tenant's tokens): the answer never waits on the store."""
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


def _check_client(request: Request) -> Tenant:
    return request.app.state.helpers.check_client(request)


def _check_admin(request: Request) -> None:
    check_admin(request, request.app.state.settings.admin_token)


async def _serve(request: Request, endpoint: str, req, prepare, body_bytes: int, tenant: Tenant) -> Response:
    st = request.app.state
    check_model(st.helpers, req.model)
    if st.prompts.kind == "kimi-k3":
        st.sampling_check(req)                   # reject bad parameters here, before any worker is busy
    # a small prompt renders and tokenises in less time than a hop to a thread costs; big ones must not
    # stall the event loop (bodies are bounded by max_request_bytes)
    inline = body_bytes <= INLINE_PREPARE_BYTES and not (endpoint == "chat" and fetches_images(req))
    prepared = prepare() if inline else await asyncio.to_thread(prepare)
    client_id = req.request_id or header_request_id(header(request, b"x-request-id"))
    trace = Trace(f"{endpoint}-{_INSTANCE}-{next(_ids)}", endpoint, client_request_id=client_id,
                  group=getattr(request.state, "kimi_pd_group", None))
    if client_id:
        log.debug("request %s is the client's %s", trace.request_id, client_id)
    outcome, ticket, streamed = "error", None, False
    if st.share is not None:
        st.share.served()

    async def admitted() -> Response:
        nonlocal ticket
        ticket = await admission_http.admit(st.admission, tenant, req, len(prepared.token_ids))
        return await st.orchestrator.handle(trace, req, prepared)
    try:
        # until the response starts (a stream's first byte, or the whole answer), a client that leaves
        # cancels both legs (or its place in the admission queue); once streaming, closing the relay does the same
        response = await until_disconnect(request, admitted())
        outcome = "ok"
        if st.share is not None and st.settings.shows_placement:   # which of the router's processes served it
            response.headers["x-kimi-pd-router-process"] = f"{st.share.index}:{os.getpid()}"
        if ticket is not None:
            streamed = admission_http.attach(ticket, response, trace, EventStreamResponse)
        return response
    except ClientDisconnected:
        outcome = "cancelled"
        raise
    except Exception as exc:
        if 400 <= getattr(exc, "status", 500) < 500:
            outcome = "client_error"         # the worker refused the request (a 4xx): not a fleet error
        raise
    finally:
        if ticket is not None and not streamed:
            ticket.leave(trace.completion_tokens if outcome == "ok" else 0, outcome)
        if trace.outcome is None:            # a stream's relay records its own outcome when it ends
            st.metrics.requests.labels(endpoint=endpoint, decision=trace.decision, outcome=outcome).inc()


INLINE_PREPARE_BYTES = 16 << 10


async def _bounded_body(request: Request) -> tuple[Any, int]:
    """The parsed JSON body and its size, refused with a 413 before it is parsed, rendered or
    tokenised when it is larger than `max_request_bytes` (placement tokenises every prompt: a 5 MB
    prompt cost 25 s of router CPU before a worker refused it), strict JSON (`shared.http.parse_json`)."""
    raw = await read_body(request, request.app.state.settings.max_request_bytes)
    return parse_json(raw), len(raw)


async def _chat(request: Request) -> Response:
    tenant = _check_client(request)
    body, size = await _bounded_body(request)
    req = ChatCompletionRequest.model_validate(body)
    st = request.app.state

    def one(sub: ChatCompletionRequest) -> Awaitable[Response]:
        return _serve(request, "chat", sub, lambda: st.prompts.prepare_chat(sub), size, tenant)
    return await _one_or_fanned_out(request, req, one)


async def _completions(request: Request) -> Response:
    tenant = _check_client(request)
    body, size = await _bounded_body(request)
    req = CompletionRequest.model_validate(body)

    def one(sub: CompletionRequest) -> Awaitable[Response]:
        return _serve(request, "completions", sub, lambda: request.app.state.prompts.prepare_completion(sub), size,
                      tenant)
    return await _one_or_fanned_out(request, req, one)


async def _one_or_fanned_out(request: Request, req: R, one) -> Response:
    """A fan-out's sub-requests share one group id, so a worker gives them one share of its batch; more
    sequences than `max_sequences_per_request` are a 400 before any is placed."""
    if not needs_fan_out(req):
        return await one(req)
    limit = request.app.state.settings.max_sequences_per_request
    sequences = len(req.prompts) * req.num_sequences if isinstance(req, CompletionRequest) else req.n
    if sequences > limit:
        raise BadRequest(f"this request asks for {sequences} sequences (prompts x n); this server allows at most "
                         f"{limit} per request", param="n")
    request.state.kimi_pd_group = f"group-{_INSTANCE}-{next(_ids)}"
    return await fan_out(req, cast(RunOne, one))


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def _ready_state(registry: WorkerRegistry) -> dict:
    usable = [s for s in registry.states() if s.healthy and not s.is_draining]
    roles = {s.info.role for s in usable}
    ready = "both" in roles or {"prefill", "decode"} <= roles or "decode" in roles
    workers = {r: sum(s.info.role == r for s in usable) for r in ("prefill", "decode", "both")}
    return {"ready": ready, "workers": workers,
            "store": "none" if registry.store is None else "ok" if registry.store_ok else "unavailable"}


async def _ready(request: Request) -> JSONResponse:
    state = _ready_state(request.app.state.registry)
    return JSONResponse(state, status_code=200 if state["ready"] else 503)


async def _metrics(request: Request) -> Response:
    st = request.app.state
    st.metrics.store_up.set(1 if st.registry.store_ok else 0)
    tail = st.registry.ledger.tail_prefill_s()
    st.metrics.tail_prefill.set(math.nan if tail is None else tail)
    if st.registry.pool is not None:
        st.metrics.kv_pool_blocks.set(st.registry.pool.num_blocks())
    counts: dict[tuple[str, str], int] = {}
    for s in st.registry.states():
        key = (s.info.role, str(s.healthy).lower())
        counts[key] = counts.get(key, 0) + 1
    for role, healthy in [*counts, *st.workers_shown]:       # set, never cleared: files outlive clear()
        st.metrics.workers.labels(role=role, healthy=healthy).set(counts.get((role, healthy), 0))
    st.workers_shown = set(counts)
    registry = st.metrics.registry if st.share is None else scrape_registry(st.share)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _list_workers(request: Request) -> JSONResponse:
    _check_admin(request)
    return JSONResponse({"workers": request.app.state.registry.snapshot()})


async def _add_worker(request: Request) -> JSONResponse:
    """Add a static worker: {"url": ..., "role": "prefill"|"decode"|"both", "kv_connector": optional
    (its pool's P/D protocol; default --kv-connector)}."""
    _check_admin(request)
    body = await read_json_object(request, request.app.state.settings.max_request_bytes)
    url, role, kind = body.get("url"), body.get("role"), body.get("kv_connector")
    if not _valid_worker_url(url) or role not in ("prefill", "decode", "both"):
        raise OpenAIError("give url (http[s]://host:port) and role (prefill, decode or both)", status=400)
    if kind is not None and (not isinstance(kind, str) or kind not in (*CONNECTORS, *CONNECTOR_ALIASES)):
        raise OpenAIError(f"kv_connector: one of {', '.join(sorted(CONNECTORS))}", status=400)
    request.app.state.registry.add_static(url, role, kind)
    return JSONResponse({"added": url})


def _valid_worker_url(url: object) -> bool:
    if not isinstance(url, str):
        return False
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError):
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host) and (port is None or 0 < port < 65536)


async def _drain_worker(request: Request, worker_id: str) -> JSONResponse:
    _check_admin(request)
    if not request.app.state.registry.drain(worker_id):
        raise OpenAIError(f"unknown worker {worker_id!r}", status=404)
    return JSONResponse({"draining": worker_id})
