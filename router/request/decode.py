"""The decode leg: the client's request (plus the transfer parameters its connector builds) on the
chosen decode worker; a worker that cannot be reached is replaced by another before anything was sent.

Retry rules: a connect failure is retried anywhere; a leg carrying transfer parameters is never
replayed after the worker may have consumed them (only decode-only bodies are replay-safe); a whole
(non-streamed) answer whose worker died before answering is asked again, decode-only, of another worker.
A stream is handed to the relay (router/request/relay.py), which migrates it if its worker dies.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from router.connectors import connector
from router.placement.ledger import Leg
from router.placement.pipeline import NoWorkerAvailable
from router.placement.types import RoutingContext, WorkerState
from router.request.fleet import Fleet
from router.request.recompute import merge_whole, recomputed, whole_continuation
from router.request.trace import PATHS, Trace, trace_headers, wire_of
from router.transport.upstream import TRANSPORT_ERRORS, UpstreamError, classify, dumps, error_body, parse_object
from router.transport.worker_http import WorkerResponse
from shared.openai.requests import SamplingRequest


def _worth_another_worker(err: UpstreamError) -> bool:
    """A whole answer lost to the worker (it died, broke the answer or failed with a 5xx) is asked of another;
    a client's 4xx, a request the router could not send, or a leg that already used its whole time is not."""
    return err.worker_fault and err.status >= 500 and err.reason != "timeout"


# a recomputed hand-back's re-run (router/request/recompute.py): its request body -> the decode worker
# placed for it, its route and its decode leg's body, after its prefill leg
Rerun = Callable[[dict], Awaitable[tuple[WorkerState, "Route", dict]]]


@dataclass
class Route:
    """Where a request's decode leg may go: placement's context, the workers, and those already tried."""

    ctx: RoutingContext
    states: list[WorkerState]
    tried: set[str] = field(default_factory=set)
    rerun: Rerun | None = None                  # how the request runs again after a recomputed hand-back


@dataclass
class Opened:
    worker: WorkerState
    resp: WorkerResponse
    leg: Leg


def decode_body(fleet: Fleet, trace: Trace, req: SamplingRequest) -> dict:
    """The decode leg's body: the client's request and what the pool's connector hands the decode."""
    body = wire_of(trace, req)
    params = connector(trace.kv_connector).decode_params(trace)
    if params is None:
        body.pop("kv_transfer_params", None)        # clients never steer transfers (SSRF, lease tampering)
    else:
        body["kv_transfer_params"] = params
    if req.stream:
        body["return_token_ids"] = True             # what a migration resumes from (stripped for the client)
    return fleet.for_worker(body)


class DecodeLeg:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def whole(self, trace: Trace, body: dict, worker: WorkerState, route: Route) -> Response:
        """A non-streamed answer; a recomputed hand-back is run again and joined to it."""
        answer = await self._answer(trace, body, worker, route)
        for _ in range(self.fleet.s.max_attempts):
            again = whole_continuation(body, answer) if recomputed(answer) else None
            if again is None or route.rerun is None:
                break
            worker, route, leg = await route.rerun(again)
            self.fleet.metrics.recomputes.labels(outcome="rerun").inc()
            answer = merge_whole(answer, await self._answer(trace, leg, worker, route))
        if recomputed(answer):
            self.fleet.metrics.recomputes.labels(outcome="failed").inc()
            raise UpstreamError("recomputed", "the decode worker gave the request back (recomputed) and it could "
                                "not be run again", 502, worker_fault=False)
        return self._respond(trace, answer)

    async def _answer(self, trace: Trace, body: dict, worker: WorkerState, route: Route) -> dict[str, Any]:
        """One whole answer. Nothing reaches the client before the whole answer, and a worker sends its
        headers only with it, so a worker that dies at any point (while the state is pulled, while it
        generates, while it answers) costs a retry, decode-only on another worker, never the answer. The
        transfer parameters are never replayed: the dead worker may have consumed them."""
        fleet = self.fleet
        for attempt in range(fleet.s.max_attempts):
            try:
                opened = await self.open(trace, body, False, worker, route)      # counts its own failures
                trace.decode_worker = opened.worker.worker_id
                try:
                    return await self._read_whole(trace, opened)
                except UpstreamError as err:
                    fleet.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                    raise
            except UpstreamError as err:
                worker, body = self._replacement(err, attempt, route, body)
                trace.decode_worker = worker.worker_id
        raise AssertionError("unreachable")

    async def open_stream(self, trace: Trace, body: dict, worker: WorkerState, route: Route) -> tuple[Opened, dict]:
        """Open a streamed decode leg. A worker that dies before its first byte reached the client is replaced,
        decode-only (never replaying the transfer parameters), as a whole answer's would be; after that the
        relay migrates. Returns the opened leg and the body it was opened with (what a migration resumes)."""
        fleet = self.fleet
        for attempt in range(fleet.s.max_attempts):
            try:
                return await self.open(trace, body, True, worker, route), body
            except UpstreamError as err:
                worker, body = self._replacement(err, attempt, route, body)
        raise AssertionError("unreachable")

    def _replacement(self, err: UpstreamError, attempt: int, route: Route, body: dict) -> tuple[WorkerState, dict]:
        """Another decode worker and the decode-only body for it, after `err` lost the leg before anything
        reached the client; re-raises `err` when it is not worth another worker or none is left."""
        fleet = self.fleet
        if not _worth_another_worker(err) or attempt + 1 >= fleet.s.max_attempts:
            raise err
        try:
            worker = fleet.pick(route.ctx, route.states, route.tried)
        except NoWorkerAvailable:
            fleet.metrics.migrations.labels(outcome="failed").inc()
            raise err from None
        fleet.metrics.migrations.labels(outcome="ok").inc()
        return worker, {k: v for k, v in body.items() if k != "kv_transfer_params"}     # decode-only

    async def open(self, trace: Trace, body: dict, stream: bool, worker: WorkerState, route: Route) -> Opened:
        """Open a decode leg; workers that cannot be reached are replaced by others (`route.tried` grows)."""
        fleet = self.fleet
        for attempt in range(fleet.s.max_attempts):
            route.tried.add(worker.worker_id)
            # decode-only: the decode worker computes the uncached prompt; it is settled by the first
            # streamed chunk or the whole answer. With a transferred state there is no prefill work.
            leg = fleet.registry.open_leg(worker.info, 0 if "kv_transfer_params" in body
                                          else route.ctx.work_tokens(worker.info), route.ctx.hashes_for(worker.info))
            try:
                return Opened(worker, await self._send(worker, trace, body, stream), leg)
            except BaseException as err:
                fleet.registry.settle_leg(leg, calibrate=False)
                if not isinstance(err, UpstreamError):
                    raise
                fleet.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                if not (err.retryable and attempt + 1 < fleet.s.max_attempts):
                    raise
                try:
                    worker = fleet.pick(route.ctx, route.states, route.tried)
                except NoWorkerAvailable:
                    raise err from None                  # nobody else: report the real failure
                fleet.metrics.retries.labels(leg="decode").inc()
        raise AssertionError("unreachable")

    async def _send(self, worker: WorkerState, trace: Trace, body: dict, stream: bool) -> WorkerResponse:
        """Send the decode leg; returns an open response with a 2xx status (its `begin` still open).

        A stream's reads are bounded by the idle timeout; a whole answer arrives only when generation is
        done, so its read is bounded by the decode timeout instead.
        """
        fleet = self.fleet
        fleet.registry.begin(worker.worker_id)
        timeout = fleet.timeouts["stream" if stream else "whole"]
        try:
            resp = await fleet.session.post(fleet.origin(worker), PATHS[trace.endpoint], dumps(body),
                                            fleet.headers(trace, worker), connect_timeout=timeout.connect_s,
                                            read_timeout=timeout.read_s)
        except TRANSPORT_ERRORS as exc:
            err = classify(exc, "decode", replay_safe="kv_transfer_params" not in body)
            fleet.registry.end(worker.worker_id, ok=err.health_outcome)
            raise err from exc
        except BaseException:
            fleet.registry.end(worker.worker_id, ok=None)
            raise
        if resp.status >= 400:
            await self._refused(worker, trace, resp)
        trace.decode_connected = True                   # from here on the decode worker owns the prefill lease
        self._observe_transfer(resp, trace, worker)
        return resp

    async def _refused(self, worker: WorkerState, trace: Trace, resp: WorkerResponse) -> None:
        status = resp.status
        try:
            content = await resp.read()
        except TRANSPORT_ERRORS:
            content = b""
        resp.close()
        self.fleet.registry.end(worker.worker_id, ok=status < 500)
        raise UpstreamError(f"http_{status // 100}xx", f"the decode worker answered {status}",
                            status, error_body(content),
                            retryable=status == 503 and trace.kv_transfer_params is None)

    def _observe_transfer(self, resp: WorkerResponse, trace: Trace, worker: WorkerState) -> None:
        """Record the decode worker's pull and queue times; a pull also teaches placement what moving
        this many tokens' state to that worker costs (router/placement/transfer.py)."""
        for header, histogram in (("x-kv-pull-seconds", self.fleet.metrics.transfer_seconds),
                                  ("x-queue-seconds", self.fleet.metrics.decode_queue)):
            value = resp.headers.get(header)
            if value:
                histogram.observe(float(value))
        pulled = resp.headers.get("x-kv-pull-seconds")
        if pulled and trace.transfer_tokens > 0:
            self.fleet.registry.transfer.observe(worker.worker_id, trace.transfer_tokens, float(pulled))

    async def _read_whole(self, trace: Trace, opened: Opened) -> dict[str, Any]:
        fleet, (worker, resp, leg) = self.fleet, (opened.worker, opened.resp, opened.leg)
        outcome: bool | None = None
        try:
            content = await resp.read()
            body = parse_object(content, "decode")
            outcome = True
        except TRANSPORT_ERRORS as exc:
            err = classify(exc, "decode")
            outcome = err.health_outcome
            raise err from exc
        except UpstreamError:
            outcome = False
            raise
        finally:
            fleet.registry.settle_leg(leg, calibrate=bool(outcome))
            if outcome:
                resp.release()                          # read to the end: the connection goes back to the pool
            else:
                resp.close()
            fleet.registry.end(worker.worker_id, outcome)
        return body

    def _respond(self, trace: Trace, body: dict[str, Any]) -> Response:
        fleet, usage = self.fleet, body.get("usage")
        # what the answer generated (admission settles by it): every part of a recomputed answer
        trace.completion_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if trace.cached_tokens is not None and isinstance(body.get("usage"), dict):
            body["usage"]["prompt_tokens_details"] = {"cached_tokens": trace.cached_tokens}
        body.pop("kv_transfer_params", None)
        elapsed = time.perf_counter() - trace.start
        fleet.metrics.ttft.observe(elapsed)
        fleet.metrics.e2e.observe(elapsed)
        return Response(dumps(body), media_type="application/json",
                        headers=trace_headers(trace, fleet.s.shows_placement))
