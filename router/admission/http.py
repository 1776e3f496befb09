"""The router app's side of admission: building it from the settings, the 429/503 responses with their
headers, the request path's hooks and `GET /admin/tenants[/{name}]`."""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.admission import Admission, Ticket
from router.admission.accounting import Accounting
from router.admission.limits import RateLimiter, Throttled
from router.admission.queue import AdmissionQueue
from router.admission.tenants import Tenant
from shared.openai.errors import OpenAIError


def build(app_state: Any, store: object | None, spawn: Callable[[Awaitable], None]) -> Admission:
    """The app's admission control; the tenants file was read (and checked) at start-up."""
    s, metrics, share = app_state.settings, app_state.metrics, getattr(app_state, "share", None)
    limiter = RateLimiter(store, f"router-{secrets.token_hex(4)}", metrics)
    if share is not None and store is None:
        limiter.replicas = share.nprocs          # no store: each router process keeps 1/N of every limit
    queue = None
    if s.max_inflight_per_worker > 0:
        def capacity() -> int:
            usable = [w for w in app_state.registry.states() if w.info.role in ("decode", "both")
                      and w.healthy and not w.is_draining]
            return len(usable) * s.max_inflight_per_worker
        queue = AdmissionQueue(capacity, s.max_queued, s.queue_timeout_s, metrics, siblings=share)
    return Admission(app_state.tenants, limiter, queue, Accounting(metrics), spawn)


async def pump_loop(admission: Admission, stop: asyncio.Event, interval_s: float = 0.25) -> None:
    """Slots that appear without a request ending here (a worker joined, one recovered, a sibling router
    process's request ended) go to waiters."""
    while not stop.is_set():
        if admission.queue is not None:
            admission.queue.pump()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def throttled(request: Request, exc: Exception) -> JSONResponse:
    """429 / 503 in OpenAI's error shape, with Retry-After and the x-ratelimit-* headers."""
    assert isinstance(exc, Throttled)
    return JSONResponse(exc.response().model_dump(mode="json"), status_code=exc.status, headers=exc.headers)


def max_tokens_of(req: Any) -> int | None:
    """The request's output budget as the workers read it (chat: max_completion_tokens wins)."""
    budget = getattr(req, "max_new_tokens", None)
    return budget if budget is not None else getattr(req, "max_tokens", None)


async def admit(admission: Admission, tenant: Tenant, req: Any, prompt_tokens: int) -> Ticket:
    """Admit `req`, then give it the priority the workers schedule by (the tenant's class first)."""
    ticket = await admission.enter(tenant, req.priority, prompt_tokens, max_tokens_of(req))
    effective = tenant.effective_priority(req.priority)
    if effective != req.priority:
        req.priority = effective
    return ticket


def attach(ticket: Ticket, response: Response, trace: Any, stream_type: type) -> bool:
    """Put the rate-limit headers on the answer; for a stream, release the ticket when it ends (its relay
    or, if it never started, the response's close). Returns True when the stream owns the ticket now."""
    for key, value in ticket.headers.items():
        response.headers[key] = value
    if not isinstance(response, stream_type):
        return False

    def end() -> None:
        ticket.leave(trace.completion_tokens, trace.outcome or "cancelled")
    trace.on_end = end
    response.on_close = end                          # type: ignore[attr-defined]
    return True


def install(app: FastAPI, check_admin: Callable[[Request], None]) -> None:
    app.add_exception_handler(Throttled, throttled)

    async def tenants(request: Request) -> JSONResponse:
        check_admin(request)
        st = request.app.state
        return JSONResponse({"tenants": st.admission.accounting.snapshot(), "rate_limits": st.admission.limiter.mode,
                             "router_replicas": st.admission.limiter.replicas})

    async def tenant(request: Request, name: str) -> JSONResponse:
        """One tenant's usage on this replica and its limits (the shared levels are in the store)."""
        check_admin(request)
        adm = request.app.state.admission
        t = adm.tenants.by_name.get(name)
        if t is None:
            raise OpenAIError(f"unknown tenant {name!r}", status=404)
        usage = adm.accounting.snapshot().get(adm.tenants.label(t))
        return JSONResponse({"tenant": name, "limits": {"rpm": t.rpm, "tpm": t.tpm, "priority": t.priority,
                                                        "queue_timeout_s": t.queue_timeout_s},
                             "usage": usage, "usage_label": adm.tenants.label(t), "rate_limits": adm.limiter.mode})

    app.add_api_route("/admin/tenants", tenants, methods=["GET"])
    app.add_api_route("/admin/tenants/{name}", tenant, methods=["GET"])
