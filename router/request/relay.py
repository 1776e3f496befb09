"""The streamed relay: a decode worker's SSE stream to the client, migrated to another decode worker
when it fails mid-stream (router/request/migration.py), so the client sees one unbroken stream. Only
when no worker can continue does it end with an SSE error event, then [DONE].

Health outcome per worker: success only with [DONE]; an upstream failure is a failure; a client that
leaves is neither. `trace.outcome`: ok, error, or cancelled (the client left).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

import httpx

from router.connectors import connector
from router.placement.pipeline import NoWorkerAvailable
from router.request.decode import DecodeLeg, Opened, Route
from router.request.fleet import Fleet
from router.request.migration import RelayedStream, continuation_body
from router.request.recompute import continuation
from router.request.trace import Trace
from router.transport.upstream import TRANSPORT_ERRORS, UpstreamError
from router.transport.worker_http import ReadTimeout
from shared.openai.sse import SSE_DONE, sse_error

log = logging.getLogger(__name__)


class Relay:
    def __init__(self, fleet: Fleet, decode: DecodeLeg) -> None:
        self.fleet, self.decode = fleet, decode

    async def stream(self, trace: Trace, keep_token_ids: bool, body: dict, opened: Opened, route: Route
                     ) -> AsyncGenerator[bytes, None]:
        """Relay the stream, migrating it on a mid-stream failure while another worker can continue."""
        stream, origin = RelayedStream(keep_token_ids=keep_token_ids, keep_text=self._stock(trace)), body
        trace.outcome = "cancelled"
        try:
            while True:
                try:
                    async for piece in self._pump(trace, opened, stream):
                        yield piece
                    if stream.recomputed:                      # vLLM-Ascend gave it back: run the rest again
                        rerun = await self._rerun(trace, origin, stream, route)
                        if rerun is None:
                            for piece in self._end_cut(trace, stream, UpstreamError("recomputed", "", 502)):
                                yield piece
                            return
                        opened, body, route = rerun
                        continue
                    trace.outcome = "error" if stream.errors else "ok"
                    return
                except UpstreamError as err:
                    log.warning("decode stream %s failed mid-stream on %s (%s): %s", trace.request_id,
                                opened.worker.worker_id, err.reason, err)
                    self.fleet.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                    moved = await self._migrate(trace, origin if self._stock(trace) else body, stream, route) \
                        if stream.resumable else None
                    if moved is None:
                        for piece in self._end_cut(trace, stream, err):
                            yield piece
                        return
                    opened = moved
        finally:
            trace.completion_tokens = None if stream.untracked else len(stream.token_ids)
            if trace.on_end is not None:
                trace.on_end()
            self.fleet.metrics.e2e.observe(time.perf_counter() - trace.start)
            self.fleet.metrics.requests.labels(endpoint=trace.endpoint, decision=trace.decision,
                                               outcome=trace.outcome).inc()

    def _end_cut(self, trace: Trace, stream: RelayedStream, err: UpstreamError) -> list[bytes]:
        """The last bytes of a stream no worker can continue."""
        if stream.finished:                 # every token was delivered; only the tail was lost
            trace.outcome = "ok"
            return [SSE_DONE]
        trace.outcome = "error"
        self.fleet.metrics.stream_errors.inc()
        return [sse_error(502, f"the decode worker failed mid-stream: {err.reason}", "upstream_error",
                          "decode_failed"), SSE_DONE]

    async def _rerun(self, trace: Trace, origin: dict, stream: RelayedStream, route: Route
                     ) -> tuple[Opened, dict, Route] | None:
        """The recomputed request's rest, placed and prefilled again, opened where the client is; None if it
        cannot be (no way to say what was delivered, no worker, or too many hand-backs)."""
        fleet, metrics = self.fleet, self.fleet.metrics.recomputes
        again = continuation(origin, "".join(stream.text), "".join(stream.reasoning),
                             None if stream.untracked else stream.token_ids, stream.delivered)
        if again is None or route.rerun is None or stream.reruns >= fleet.s.max_attempts:
            metrics.labels(outcome="failed").inc()
            return None
        stream.reruns += 1
        try:
            worker, route, leg = await route.rerun(again)
            opened, leg = await self.decode.open_stream(trace, leg, worker, route)
        except (UpstreamError, NoWorkerAvailable) as exc:
            log.warning("recomputed stream %s could not be run again: %s", trace.request_id, exc)
            metrics.labels(outcome="failed").inc()
            return None
        metrics.labels(outcome="rerun").inc()
        trace.decode_worker = opened.worker.worker_id
        stream.rerun()
        return opened, leg, route

    def _stock(self, trace: Trace) -> bool:
        return connector(trace.kv_connector).vllm

    async def _migrate(self, trace: Trace, body: dict, stream: RelayedStream, route: Route) -> Opened | None:
        """Open the continuation on another decode worker, or None if none can. Our workers resume from the
        delivered tokens (`kimi_pd_resume`); stock vLLM, which knows no such field, gets the request with
        what was delivered in its context (`body` is then the first leg's, router/request/recompute.py)."""
        fleet, stock = self.fleet, self._stock(trace)
        if stock:
            rest = continuation(body, "".join(stream.text), "".join(stream.reasoning), stream.token_ids,
                                stream.delivered)
            if rest is None:
                fleet.metrics.migrations.labels(outcome="failed").inc()
                return None
            rest = {**rest, "stream": True, "return_token_ids": True}
        else:
            rest = continuation_body(body, stream)
        try:
            opened = await self.decode.open(trace, rest, True,
                                            fleet.pick(route.ctx, route.states, route.tried), route)
        except (UpstreamError, NoWorkerAvailable) as exc:
            log.warning("stream %s could not be migrated: %s", trace.request_id, exc)
            fleet.metrics.migrations.labels(outcome="failed").inc()
            return None
        log.info("stream %s migrated to %s after %d tokens", trace.request_id, opened.worker.worker_id,
                 len(stream.token_ids))
        fleet.metrics.migrations.labels(outcome="ok").inc()
        if stock:
            stream.rerun()                    # a fresh request: its usage counts only what it generated
        else:
            stream.restart()
        return opened

    async def _pump(self, trace: Trace, opened: Opened, stream: RelayedStream) -> AsyncGenerator[bytes, None]:
        """Relay one upstream until [DONE]; a cut, silent or truncated upstream raises UpstreamError.
        Always closes the response and ends the worker's `begin`."""
        fleet, resp, leg = self.fleet, opened.resp, opened.leg
        outcome, last_at = None, None
        try:
            # the idle timeout is the client's read bound (set when the leg opened): a wait_for per
            # chunk cost a task and a timer per streamed token
            async for chunk in resp.iter_any():
                now = time.perf_counter()
                if last_at is None:
                    fleet.registry.settle_leg(leg)            # the prompt is computed: the first token is out
                    if not stream.continuation:
                        fleet.metrics.ttft.observe(now - trace.start)
                else:
                    fleet.metrics.tpot.observe(now - last_at)
                last_at = now
                errors = stream.errors
                out = stream.feed(chunk)
                if stream.errors > errors:
                    fleet.metrics.stream_errors.inc(stream.errors - errors)
                if out:
                    yield out
                if stream.done:
                    break
            if not stream.done:
                raise UpstreamError("truncated", "the decode worker ended the stream early", 502)
            outcome = True
        except TRANSPORT_ERRORS as exc:
            outcome = False
            reason = "timeout" if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException, ReadTimeout)) \
                else "transport"
            raise UpstreamError(reason, str(exc) or type(exc).__name__, 502) from exc
        except UpstreamError:
            outcome = False
            raise
        finally:
            fleet.registry.settle_leg(leg, calibrate=False)     # no-op once the first chunk settled it
            if outcome:
                resp.release()
            else:
                resp.close()                          # client gone or failed: D sees the disconnect and aborts
            fleet.registry.end(opened.worker.worker_id, outcome)
