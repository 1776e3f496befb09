"""One client request through the fleet (docs/design.md "Request path"): its outline.

    place decode worker D (prefix + load) -> decide: uncached tokens on D < threshold ? decode-only
        : expected state pull to D > D prefilling the uncached tokens ? decode-only (router/placement/transfer.py)
    prefill-decode: P leg (max_tokens=1, do_remote_decode) -> kv_transfer_params -> D leg (streamed)

Each stage lives in its own module of router/request/: the prefill leg (`prefill`), the decode leg
(`decode`), the streamed relay with mid-stream migration (`relay`); what a P/D protocol does differently
lives in its connector (router/connectors.py), so nothing here branches on one.

Guarantees: connect failures are retried on a different worker; every leg has timeouts; a stream
that fails after it started ends with an SSE `error` event then [DONE]; a client that goes away
aborts both legs (the D connection is closed; a prefill state no D ever received is released).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import partial

import httpx
from fastapi.responses import Response

from router.metrics import RouterMetrics
from router.placement.context import build_context
from router.placement.pipeline import Decision, NoWorkerAvailable, Pipeline, decide_disaggregation
from router.placement.transfer import Reason, transfer_decision
from router.placement.types import RoutingContext, WorkerState
from router.registry import WorkerRegistry
from router.request.decode import DecodeLeg, Route, decode_body
from router.request.fleet import Fleet
from router.request.leases import LeaseKeeper
from router.request.prefill import PrefillLeg
from router.request.relay import Relay
from router.request.trace import Trace, trace_headers
from router.settings import RouterSettings
from router.transport.fast_path import EventStreamResponse
from router.transport.worker_http import WorkerClient
from shared.openai.requests import SamplingRequest
from shared.prompt.prepare import PreparedPrompt
from shared.workers import Role

__all__ = ["Orchestrator", "Trace", "trace_headers"]


class Orchestrator:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, client: httpx.AsyncClient,
                 pipeline: Pipeline, metrics: RouterMetrics, admin_token: str | None,
                 session: WorkerClient) -> None:
        self.fleet = Fleet(settings, registry, client, pipeline, metrics, admin_token, session)
        self.s, self.registry, self.pipeline, self.metrics = settings, registry, pipeline, metrics
        self.prefill, self.decode = PrefillLeg(self.fleet), DecodeLeg(self.fleet)
        self.relay = Relay(self.fleet, self.decode)
        self.leases = LeaseKeeper(self.fleet)        # renews prefill states until their decode worker answers
        self._background: set[asyncio.Task] = set()

    async def handle(self, trace: Trace, req: SamplingRequest, prepared: PreparedPrompt) -> Response:
        try:
            return await self._handle(trace, req, prepared)
        except BaseException:
            # client gone or a leg failed: never strand a prefill state that no decode worker took
            task = asyncio.get_running_loop().create_task(self.release_prefill(trace))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise

    async def release_prefill(self, trace: Trace) -> None:
        await self.prefill.release(trace)

    async def _handle(self, trace: Trace, req: SamplingRequest, prepared: PreparedPrompt) -> Response:
        decode, route = await self._place(trace, req, prepared)
        async with self.leases.kept(trace):
            return await self._call_decode(trace, req, decode, route)

    async def _rerun(self, trace: Trace, req: SamplingRequest, prepared: PreparedPrompt, body: dict
                     ) -> tuple[WorkerState, Route, dict]:
        """A recomputed hand-back's rest (router/request/recompute.py), run as the protocol says: placed and
        prefilled again. Placement reads the original prompt's hashes (a prefix of the new context)."""
        again = type(req).model_validate(body)
        trace.kv_transfer_params = trace.decode_params = trace.prefill_worker = None
        trace.decode_connected = False
        decode, route = await self._place(trace, again, prepared)
        route.tried |= self.fleet.other_pools(route.states, trace.kv_connector)
        return decode, route, decode_body(self.fleet, trace, again)

    async def _place(self, trace: Trace, req: SamplingRequest, prepared: PreparedPrompt
                     ) -> tuple[WorkerState, Route]:
        """The decode worker and the decision; the prefill leg when the decision is prefill-decode."""
        states = self.registry.states()
        ctx = self._context(trace, prepared, states, "decode")
        decode = self.fleet.pick(ctx, states, exclude=set())
        trace.decision, reason, prefill_ctx, passed = self._decide(ctx, decode, states)
        self.metrics.decision_reasons.labels(decision=trace.decision, reason=reason).inc()
        if trace.decision == "prefill-decode":
            trace.transfer_tokens = ctx.uncached_tokens(decode.info)
        trace.kv_connector = self.registry.connector_of(decode.worker_id).name
        if trace.decision == "prefill-decode":
            assert prefill_ctx is not None
            # only prefill workers of the decode's pool (same connector) can hand it their KV
            other_pools = {w.worker_id for w in states if w.info.role == "prefill"
                           and self.registry.connector_of(w.worker_id).name != trace.kv_connector}
            await self.prefill.run(trace, req, prefill_ctx, states, other_pools, passed)
        self.metrics.decisions.labels(decision=trace.decision).inc()
        self.fleet.record_sent(ctx, decode)
        return decode, Route(ctx, states, rerun=partial(self._rerun, trace, req, prepared))

    def _context(self, trace: Trace, prepared: PreparedPrompt, states: list[WorkerState], role: Role
                 ) -> RoutingContext:
        return build_context(trace.request_id, prepared.token_ids, states, self.registry.index,
                             model=self.s.served_model_name, role=role, now=time.time(),
                             images=prepared.image_spans(), cache_salt=prepared.cache_salt,
                             tail_prefill_s=self.registry.ledger.tail_prefill_s(), pool=self.registry.pool)

    def _decide(self, ctx: RoutingContext, decode: WorkerState, states: list[WorkerState]
                ) -> tuple[Decision, Reason, RoutingContext | None, tuple[WorkerState, ...] | None]:
        """Decode-only when little of the prompt is uncached on the chosen decode worker, when no
        prefill worker passes the same filters placement uses, or when moving the state is expected to take
        longer than the decode worker computing it (`transfer_decision`). Returns the decision, why, the
        prefill context and the workers that passed the prefill filters (the prefill pick reuses them).
        The threshold is asked first: it needs no filter pass."""
        uncached = ctx.uncached_tokens(decode.info)
        if decode.info.role != "prefill" and uncached < self.s.disagg_threshold_tokens:
            return "decode-only", "below-threshold", None, None
        prefill_ctx = replace(ctx, role="prefill")      # same prompt hashes and cached prefixes
        try:
            passed = self.pipeline.candidates(prefill_ctx, states)
        except NoWorkerAvailable:
            passed = ()
        kind = self.registry.connector_of(decode.worker_id).name
        if not any(w.info.role == "prefill" and self.registry.connector_of(w.worker_id).name == kind for w in passed):
            return "decode-only", "no-prefill-worker", prefill_ctx, passed    # none speaks this decode's protocol
        decide_disaggregation(ctx, decode, self.s.disagg_threshold_tokens)     # refuses a prefill worker as D
        # uncached, not work_tokens: a colocated worker behind a KV pool gets the pool's blocks from the pool
        # whichever way the prompt goes, so only the part it would compute weighs against the move
        decision, reason = transfer_decision(uncached, self.s.disagg_threshold_tokens,
                                             self.registry.transfer.expected_s(decode.worker_id, uncached),
                                             decode.tokens_per_s)
        return decision, reason, prefill_ctx, passed

    async def _call_decode(self, trace: Trace, req: SamplingRequest, decode: WorkerState, route: Route) -> Response:
        """Open the decode leg (the decode pool's protocol only); relay a stream, or read the whole answer."""
        body = decode_body(self.fleet, trace, req)
        route.tried |= self.fleet.other_pools(route.states, trace.kv_connector)
        trace.decode_worker = decode.worker_id
        if not req.stream:
            return await self.decode.whole(trace, body, decode, route)
        opened, body = await self.decode.open_stream(trace, body, decode, route)
        trace.decode_worker = opened.worker.worker_id
        trace.outcome = "cancelled"                  # until the relay says otherwise; it records the request
        relay = self.relay.stream(trace, bool(req.return_token_ids), body, opened, route)
        return EventStreamResponse(relay, headers=trace_headers(trace, self.fleet.s.shows_placement))
