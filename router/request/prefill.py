"""The prefill leg: one token on a prefill worker of the decode's pool, retried on another when the
worker cannot be reached, shaped and adopted by the pool's connector (router/connectors.py).

A prefill pool that is down or failing costs latency, not the request: the decode worker computes the
prompt (`run` falls back). A prefill state that no decode worker received is released at once (`release`)
instead of at lease expiry.
"""
from __future__ import annotations

import logging
import time

import httpx

from router.connectors import Connector, connector
from router.placement.pipeline import NoWorkerAvailable
from router.placement.types import RoutingContext, WorkerState
from router.request.fleet import Fleet
from router.request.leases import renew_headers
from router.request.trace import PATHS, Trace, wire_of
from router.transport.upstream import JsonReply, UpstreamError, post_json
from shared.openai.legs import prefill_body
from shared.openai.requests import SamplingRequest

log = logging.getLogger(__name__)
ADMIN_HEADER = "authorization"


class PrefillLeg:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def run(self, trace: Trace, req: SamplingRequest, ctx: RoutingContext, states: list[WorkerState],
                  exclude: set[str], passed: tuple[WorkerState, ...] | None = None) -> None:
        """The prefill leg, or the fallback to decode-only when no prefill worker can do it."""
        try:
            await self._attempts(trace, req, ctx, states, exclude, passed)
        except NoWorkerAvailable as exc:
            self._fall_back(trace, "no_worker", exc)
        except UpstreamError as err:
            if err.status < 500:
                raise                                    # the client's request is wrong: same on every worker
            self._fall_back(trace, err.reason, err)

    def _fall_back(self, trace: Trace, reason: str, exc: Exception) -> None:
        log.warning("prefill leg of %s failed (%s); decode worker computes the prompt: %s", trace.request_id,
                    reason, exc)
        self.fleet.metrics.prefill_fallbacks.labels(reason=reason).inc()
        trace.decision, trace.kv_transfer_params, trace.decode_params = "decode-only", None, None
        trace.transfer_tokens = 0                        # nothing to pull: no transfer to learn from

    async def _attempts(self, trace: Trace, req: SamplingRequest, ctx: RoutingContext, states: list[WorkerState],
                        exclude: set[str], passed: tuple[WorkerState, ...] | None) -> None:
        """`passed`: the workers of `states` that passed the prefill filters; the first pick reuses them
        when nothing is excluded (the same filters over the same workers)."""
        fleet, tried = self.fleet, set(exclude)
        kind = connector(trace.kv_connector)
        plan = kind.prepare(trace.request_id)
        body = fleet.for_worker(prefill_body(req, wire_of(trace, req)))
        body.update(plan.fields, kv_transfer_params=plan.params)
        for attempt in range(fleet.s.max_attempts):
            if attempt == 0 and passed and not tried:
                worker = fleet.pipeline.pick_among(ctx, passed).worker
            else:
                worker = fleet.pick(ctx, states, tried)
            tried.add(worker.worker_id)
            await kind.ready(worker, fleet)
            try:
                reply = await self._send(trace, ctx, worker, body)
            except UpstreamError as err:
                fleet.metrics.leg_failures.labels(leg="prefill", reason=err.reason).inc()
                if err.retryable and attempt + 1 < fleet.s.max_attempts:
                    fleet.metrics.retries.labels(leg="prefill").inc()
                    log.warning("prefill leg of %s on %s failed (%s); trying another worker", trace.request_id,
                                worker.worker_id, err.reason)
                    continue
                raise
            self._adopt(trace, kind, worker, reply, plan)
            return

    async def _send(self, trace: Trace, ctx: RoutingContext, worker: WorkerState, body: dict) -> JsonReply:
        fleet = self.fleet
        start = time.perf_counter()
        fleet.record_sent(ctx, worker)
        leg = fleet.registry.open_leg(worker.info, ctx.work_tokens(worker.info), ctx.hashes_for(worker.info))
        answered = False
        try:
            reply = await fleet.call(worker, lambda: post_json(
                fleet.session, fleet.origin(worker), PATHS[trace.endpoint], body, fleet.timeouts["prefill"],
                {**fleet.headers(trace, worker), **renew_headers(fleet, worker.worker_id)}, "prefill"))
            answered = True
        finally:
            fleet.registry.settle_leg(leg, calibrate=answered)
        fleet.metrics.prefill_seconds.observe(time.perf_counter() - start)
        return reply

    def _adopt(self, trace: Trace, kind: Connector, worker: WorkerState, reply: JsonReply, plan) -> None:
        trace.prefill_worker = worker.worker_id
        details = (reply.body.get("usage") or {}).get("prompt_tokens_details") or {}
        trace.cached_tokens = details.get("cached_tokens")
        kind.adopt(trace, worker, reply.body.get("kv_transfer_params"), plan, self.fleet)

    async def release(self, trace: Trace) -> None:
        """A prefill state that no decode worker received is released now instead of at lease expiry."""
        fleet, ktp = self.fleet, trace.kv_transfer_params
        if ktp is None or trace.decode_connected or not trace.prefill_worker:
            return
        if not fleet.registry.is_proven(trace.prefill_worker):
            return           # /internal/kv/release is ours, for proven workers only; vLLM frees at its own timeout
        info = fleet.registry.all_infos().get(trace.prefill_worker)
        if info is None or not fleet.admin_token:
            return
        try:
            resp = await fleet.client.post(f"{info.url}/internal/kv/release",
                                           json={"request_id": ktp.remote_request_id},
                                           headers={ADMIN_HEADER: f"Bearer {fleet.admin_token}"},
                                           timeout=fleet.s.connect_timeout_s)
            released = resp.status_code == 200 and resp.json().get("released") is True
            fleet.metrics.prefill_releases.labels(outcome="released" if released else "not_held").inc()
            if resp.status_code != 200:
                log.warning("prefill worker refused to release %s: %s", trace.request_id, resp.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            fleet.metrics.prefill_releases.labels(outcome="failed").inc()
            log.warning("could not release prefill state of %s: %s", trace.request_id, exc)
