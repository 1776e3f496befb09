"""One client request through the fleet (DESIGN.md "Request path").

    place decode worker D (prefix + load) -> decide: uncached tokens on D < threshold ? decode-only
    prefill-decode: P leg (max_tokens=1, do_remote_decode) -> kv_transfer_params -> D leg (streamed)

Guarantees: connect failures are retried on a different worker; every leg has timeouts; a stream
that fails after it started ends with an SSE `error` event then [DONE]; a client that goes away
aborts both legs (the D connection is closed; a prefill state no D ever received is released).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import httpx
from fastapi.responses import Response

from router.connectors import connector, engine_id_from_query, mooncake_decode_params
from router.fast_path import EventStreamResponse
from router.metrics import RouterMetrics
from router.migration import RelayedStream, continuation_body
from router.placement.context import build_context
from router.placement.ledger import Leg
from router.placement.pipeline import NoWorkerAvailable, Pipeline, decide_disaggregation
from router.placement.types import RoutingContext, WorkerState
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from router.upstream import (
    TRANSPORT_ERRORS,
    UpstreamError,
    classify,
    dumps,
    error_body,
    leg_timeout,
    parse_object,
    post_json,
)
from router.worker_http import Origin, ReadTimeout, WorkerClient, WorkerResponse
from shared.kv_transfer_params import KVTransferParams
from shared.openai.legs import decode_body, prefill_body, wire_body
from shared.openai.sse import SSE_DONE, sse_error
from shared.prompt.prepare import PreparedPrompt

log = logging.getLogger(__name__)
ADMIN_HEADER = "authorization"
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}     # endpoint -> the workers' path


def trace_headers(trace: Trace) -> dict[str, str]:
    """Where a request went: for clients' tracing and for tests (worker ids, never secrets)."""
    headers = {"x-request-id": trace.request_id, "x-kimi-pd-decision": trace.decision}
    if trace.prefill_worker:
        headers["x-kimi-pd-prefill-worker"] = trace.prefill_worker
    if trace.decode_worker:
        headers["x-kimi-pd-decode-worker"] = trace.decode_worker
    return headers


@dataclass
class Trace:
    request_id: str                                  # the router's own id: what workers see (never the client's)
    endpoint: str
    client_request_id: str | None = None             # the client's validated id, for logs only
    decision: str = "none"
    start: float = field(default_factory=time.perf_counter)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    cached_tokens: int | None = None
    kv_transfer_params: KVTransferParams | None = None
    decode_params: dict | None = None                # a stock vLLM decode leg's kv_transfer_params, as sent
    kv_connector: str = "kimi-pd"                    # the P/D protocol of this request's pool
    decode_connected: bool = False
    outcome: str | None = None                       # a stream's outcome, set when its relay ends


class Orchestrator:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, client: httpx.AsyncClient,
                 pipeline: Pipeline, metrics: RouterMetrics, admin_token: str | None,
                 session: WorkerClient) -> None:
        self.s, self.registry, self.client, self.session = settings, registry, client, session
        self.pipeline, self.metrics, self.admin_token = pipeline, metrics, admin_token
        self._background: set[asyncio.Task] = set()
        # built once, not per leg: timeouts, the auth header, parsed worker URLs
        self._timeouts = {kind: leg_timeout(settings.connect_timeout_s, read) for kind, read in (
            ("prefill", settings.prefill_timeout_s), ("stream", settings.idle_timeout_s),
            ("whole", settings.decode_timeout_s))}
        token = settings.worker_api_key or (admin_token if settings.api_keys else None)
        # with client keys on, our workers only serve authenticated callers (our admin token); a stock
        # vLLM worker never sees that token: it gets its own --api-key (KIMI_PD_WORKER_API_KEY) or nothing
        self._auth = {"authorization": f"Bearer {token}"} if token else {}
        vllm_key = settings.worker_api_key
        self._vllm_auth = {"authorization": f"Bearer {vllm_key}"} if vllm_key else {}


    # ---- entry --------------------------------------------------------------------------------
    async def handle(self, trace: Trace, req, prepared: PreparedPrompt) -> Response:
        try:
            return await self._handle(trace, req, prepared)
        except BaseException:
            # client gone or a leg failed: never strand a prefill state that no decode worker took
            task = asyncio.get_running_loop().create_task(self.release_prefill(trace))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise

    async def _handle(self, trace: Trace, req, prepared: PreparedPrompt) -> Response:
        states = self.registry.states()
        ctx = self._context(trace, prepared, states, "decode")
        decode = self._pick(ctx, states, exclude=set())
        trace.decision, prefill_ctx, passed = self._decide(ctx, decode, states)
        trace.kv_connector = self.registry.connector_of(decode.worker_id).name
        if trace.decision == "prefill-decode":
            # only prefill workers of the decode's pool (same connector) can hand it their KV
            other_pools = {w.worker_id for w in states if w.info.role == "prefill"
                           and self.registry.connector_of(w.worker_id).name != trace.kv_connector}
            await self._prefill_or_fall_back(trace, req, prefill_ctx, states, other_pools, passed)
        self.metrics.decisions.labels(decision=trace.decision).inc()
        self._record_sent(ctx, decode)
        return await self._decode_leg(trace, req, decode, ctx, states)

    def _context(self, trace: Trace, prepared: PreparedPrompt, states, role: str) -> RoutingContext:
        return build_context(trace.request_id, prepared.token_ids, states, self.registry.index,
                             model=self.s.served_model_name, role=role, now=time.time(),
                             images=prepared.image_spans(), cache_salt=prepared.cache_salt)

    def _pick(self, ctx: RoutingContext, states: list[WorkerState], exclude: set[str]) -> WorkerState:
        candidates = [w for w in states if w.worker_id not in exclude]
        return self.pipeline.pick(ctx, candidates).worker         # NoWorkerAvailable is the client's 503

    def _decide(self, ctx: RoutingContext, decode: WorkerState, states: list[WorkerState]
                ) -> tuple[str, RoutingContext | None, tuple[WorkerState, ...] | None]:
        """Decode-only when little of the prompt is uncached on the chosen decode worker, or when no
        prefill worker passes the same filters placement uses. Returns the decision, the prefill
        context and the workers that passed the prefill filters (the prefill pick reuses them).
        The threshold is asked first: it needs no filter pass."""
        if decode.info.role != "prefill" and ctx.uncached_tokens(decode.info) < self.s.disagg_threshold_tokens:
            return "decode-only", None, None
        prefill_ctx = replace(ctx, role="prefill")      # same prompt hashes and cached prefixes
        try:
            passed = self.pipeline.candidates(prefill_ctx, states)
        except NoWorkerAvailable:
            passed = ()
        kind = self.registry.connector_of(decode.worker_id).name
        if not any(w.info.role == "prefill" and self.registry.connector_of(w.worker_id).name == kind for w in passed):
            return "decode-only", prefill_ctx, passed    # no prefill worker speaks this decode's protocol
        return decide_disaggregation(ctx, decode, self.s.disagg_threshold_tokens), prefill_ctx, passed

    def _record_sent(self, ctx: RoutingContext, worker: WorkerState) -> None:
        self.registry.index.record_sent(worker.worker_id, ctx.hashes_for(worker.info))

    # ---- prefill leg --------------------------------------------------------------------------
    async def _prefill_or_fall_back(self, trace: Trace, req, ctx: RoutingContext, states: list[WorkerState],
                                    exclude: set[str], passed: tuple[WorkerState, ...] | None = None) -> None:
        """A prefill pool that is down or failing costs latency, not the request: decode computes it."""
        try:
            await self._prefill_leg(trace, req, ctx, states, exclude, passed)
        except NoWorkerAvailable as exc:
            self._fall_back(trace, "no_worker", exc)
        except UpstreamError as err:
            if err.status < 500:
                raise                                    # the client's request is wrong: same on every worker
            self._fall_back(trace, err.reason, err)

    def _fall_back(self, trace: Trace, reason: str, exc: Exception) -> None:
        log.warning("prefill leg of %s failed (%s); decode worker computes the prompt: %s", trace.request_id,
                    reason, exc)
        self.metrics.prefill_fallbacks.labels(reason=reason).inc()
        trace.decision, trace.kv_transfer_params, trace.decode_params = "decode-only", None, None

    async def _prefill_leg(self, trace: Trace, req, ctx: RoutingContext, states: list[WorkerState],
                           exclude: set[str], passed: tuple[WorkerState, ...] | None = None) -> None:
        """`passed`: the workers of `states` that passed the prefill filters (`_decide`); the first
        pick reuses them when nothing is excluded (the same filters over the same workers)."""
        tried: set[str] = set(exclude)
        kind = connector(trace.kv_connector)
        transfer_id = kind.new_transfer_id(trace.request_id)
        body = self._for_worker(prefill_body(req))
        body["kv_transfer_params"] = kind.prefill_params(transfer_id)
        timeout = self._timeouts["prefill"]
        for attempt in range(self.s.max_attempts):
            if attempt == 0 and passed and not tried:
                worker = self.pipeline.pick_among(ctx, passed).worker
            else:
                worker = self._pick(ctx, states, tried)
            tried.add(worker.worker_id)
            if kind.router_transfer_id and await self._mooncake_engine(worker) is None:
                # asked before the prefill is sent, so a failure strands no blocks held for a transfer
                raise UpstreamError("no_engine_id", "the prefill worker's Mooncake bootstrap server did not "
                                    "name its engine", 502, worker_fault=False)
            start = time.perf_counter()
            self._record_sent(ctx, worker)               # FIFO: what later requests will find cached there
            leg = self.registry.ledger.open(worker.worker_id, ctx.uncached_tokens(worker.info))
            answered = False
            try:
                reply = await self._call(worker, lambda w=worker: post_json(
                    self.session, self._origin(w), _PATHS[trace.endpoint], body, timeout, self._headers(trace, w),
                    "prefill"))
                answered = True
            except UpstreamError as err:
                self.metrics.leg_failures.labels(leg="prefill", reason=err.reason).inc()
                if err.retryable and attempt + 1 < self.s.max_attempts:
                    self.metrics.retries.labels(leg="prefill").inc()
                    log.warning("prefill leg of %s on %s failed (%s); trying another worker", trace.request_id,
                                worker.worker_id, err.reason)
                    continue
                raise
            finally:
                self.registry.ledger.settle(leg, calibrate=answered)
            self.metrics.prefill_seconds.observe(time.perf_counter() - start)
            trace.prefill_worker = worker.worker_id
            details = (reply.body.get("usage") or {}).get("prompt_tokens_details") or {}
            trace.cached_tokens = details.get("cached_tokens")
            await self._adopt_prefill_answer(trace, kind, worker, reply.body.get("kv_transfer_params"), transfer_id)
            return

    async def _adopt_prefill_answer(self, trace: Trace, kind, worker: WorkerState, raw, transfer_id: str | None
                                    ) -> None:
        """What the decode leg gets, per the pool's protocol (router/connectors.py). A protocol that
        promises parameters and got none is a real fallback: the decode computes the prompt."""
        if kind.router_transfer_id:                    # upstream Mooncake: the router arranges the pull
            engine = self.registry.mooncake_engines[worker.worker_id]      # asked before the prefill leg
            trace.decode_params = mooncake_decode_params(transfer_id, engine, self._bootstrap_addr(worker))
            return
        if not kind.answers_params:                    # storage-backed: the decode finds the KV itself
            return
        if not (raw and isinstance(raw, dict)):
            raise UpstreamError("no_kv_transfer_params", f"the prefill worker answered no kv_transfer_params "
                                f"({kind.name} always sends them)", 502, worker_fault=False)
        trace.kv_transfer_params = KVTransferParams.from_dict(raw)
        if kind.vllm:
            trace.decode_params = dict(raw)            # forwarded exactly as the prefill's vLLM wrote it

    def _bootstrap_addr(self, worker: WorkerState) -> str:
        host = httpx.URL(worker.info.url).host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.s.mooncake_bootstrap_port}"

    async def _mooncake_engine(self, worker: WorkerState) -> str | None:
        """A prefill's engine id, from its bootstrap server's /query (asked once, then cached)."""
        known = self.registry.mooncake_engines.get(worker.worker_id)
        if known:
            return known
        try:
            resp = await self.client.get(self._bootstrap_addr(worker) + "/query", timeout=self.s.connect_timeout_s)
            engine = engine_id_from_query(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("Mooncake bootstrap of %s unreachable: %s", worker.worker_id, exc)
            return None
        if engine:
            self.registry.mooncake_engines[worker.worker_id] = engine
        return engine

    async def _call(self, worker: WorkerState, send):
        """begin/end around one call; a cancelled call (client gone) records no health outcome."""
        self.registry.begin(worker.worker_id)
        outcome: bool | None = None
        try:
            result = await send()
            outcome = True
            return result
        except UpstreamError as err:
            outcome = err.health_outcome
            raise
        finally:
            self.registry.end(worker.worker_id, outcome)

    # ---- decode leg ---------------------------------------------------------------------------
    def _decode_body(self, trace: Trace, req) -> dict:
        if trace.decode_params is not None:              # a stock vLLM pool: its connector's own params
            body = wire_body(req)
            body["kv_transfer_params"] = dict(trace.decode_params)
        elif trace.kv_transfer_params is not None:
            body = decode_body(req, trace.kv_transfer_params)
        else:
            body = wire_body(req)
            body.pop("kv_transfer_params", None)        # clients never steer transfers (SSRF, lease tampering)
        if req.stream:
            body["return_token_ids"] = True             # what a migration resumes from (stripped for the client)
        return self._for_worker(body)

    def _for_worker(self, body: dict) -> dict:
        """Workers know the model by its first served name; clients may use any alias."""
        if body.get("model") in self.s.served_model_aliases:
            body["model"] = self.s.served_model_name
        return body

    async def _decode_leg(self, trace: Trace, req, decode: WorkerState, ctx: RoutingContext,
                          states: list[WorkerState]) -> Response:
        body = self._decode_body(trace, req)
        tried = {w.worker_id for w in states if self.registry.connector_of(w.worker_id).name != trace.kv_connector}
        worker, resp, leg = await self._open_with_retries(trace, body, req.stream, decode, ctx, states, tried)
        trace.decode_worker = worker.worker_id
        if req.stream:
            trace.outcome = "cancelled"                  # until the relay says otherwise; it records the request
            relay = self._relay(trace, req, body, worker, resp, ctx, states, tried, leg)
            return EventStreamResponse(relay, headers=trace_headers(trace))
        for attempt in range(self.s.max_attempts):
            try:
                return await self._whole(trace, worker, resp, leg)
            except UpstreamError as err:
                # nothing reached the client yet: a worker that died answering costs a retry, not the answer
                self.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                if err.status < 500 or attempt + 1 >= self.s.max_attempts:
                    raise
                try:
                    retry = {k: v for k, v in body.items() if k != "kv_transfer_params"}   # decode-only
                    worker, resp, leg = await self._open_with_retries(trace, retry, False,
                                                                      self._pick(ctx, states, tried), ctx, states, tried)
                except (UpstreamError, NoWorkerAvailable):
                    self.metrics.migrations.labels(outcome="failed").inc()
                    raise err from None
                self.metrics.migrations.labels(outcome="ok").inc()
                trace.decode_worker = worker.worker_id
        raise AssertionError("unreachable")

    async def _open_with_retries(self, trace: Trace, body: dict, stream: bool, worker: WorkerState,
                                 ctx: RoutingContext, states: list[WorkerState], tried: set[str]):
        """Open a decode leg; workers that cannot be reached are replaced by others (`tried` grows)."""
        for attempt in range(self.s.max_attempts):
            tried.add(worker.worker_id)
            # decode-only: the decode worker computes the uncached prompt; it is settled by the first
            # streamed chunk or the whole answer. With a transferred state there is no prefill work.
            leg = self.registry.ledger.open(worker.worker_id, 0 if "kv_transfer_params" in body
                                            else ctx.uncached_tokens(worker.info))
            try:
                resp = await self._open(worker, trace, body, stream)
                break
            except BaseException as err:
                self.registry.ledger.settle(leg, calibrate=False)
                if not isinstance(err, UpstreamError):
                    raise
                self.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                if not (err.retryable and attempt + 1 < self.s.max_attempts):
                    raise
                try:
                    worker = self._pick(ctx, states, tried)
                except NoWorkerAvailable:
                    raise err from None                  # nobody else: report the real failure
                self.metrics.retries.labels(leg="decode").inc()
        return worker, resp, leg

    async def _open(self, worker: WorkerState, trace: Trace, body: dict, stream: bool) -> WorkerResponse:
        """Send the decode leg; returns an open response with a 2xx status (its `begin` still open).

        A stream's reads are bounded by the idle timeout; a whole answer arrives only when generation is
        done, so its read is bounded by the decode timeout instead.
        """
        self.registry.begin(worker.worker_id)
        timeout = self._timeouts["stream" if stream else "whole"]
        try:
            resp = await self.session.post(self._origin(worker), _PATHS[trace.endpoint], dumps(body),
                                           self._headers(trace, worker), connect_timeout=timeout.connect_s,
                                           read_timeout=timeout.read_s)
        except TRANSPORT_ERRORS as exc:
            err = classify(exc, "decode", replay_safe="kv_transfer_params" not in body)
            self.registry.end(worker.worker_id, ok=err.health_outcome)
            raise err from exc
        except BaseException:
            self.registry.end(worker.worker_id, ok=None)
            raise
        if resp.status >= 400:
            status = resp.status
            try:
                content = await resp.read()
            except TRANSPORT_ERRORS:
                content = b""
            resp.close()
            self.registry.end(worker.worker_id, ok=status < 500)
            raise UpstreamError(f"http_{status // 100}xx", f"the decode worker answered {status}",
                                status, error_body(content),
                                retryable=status == 503 and trace.kv_transfer_params is None)
        trace.decode_connected = True                   # from here on the decode worker owns the prefill lease
        self._observe_transfer(resp)
        return resp

    def _observe_transfer(self, resp: WorkerResponse) -> None:
        for header, histogram in (("x-kv-pull-seconds", self.metrics.transfer_seconds),
                                  ("x-queue-seconds", self.metrics.decode_queue)):
            value = resp.headers.get(header)
            if value:
                histogram.observe(float(value))

    async def _whole(self, trace: Trace, worker: WorkerState, resp: WorkerResponse, leg: Leg) -> Response:
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
            self.registry.ledger.settle(leg, calibrate=bool(outcome))
            if outcome:
                resp.release()                          # read to the end: the connection goes back to the pool
            else:
                resp.close()
            self.registry.end(worker.worker_id, outcome)
        if trace.cached_tokens is not None and isinstance(body.get("usage"), dict):
            body["usage"]["prompt_tokens_details"] = {"cached_tokens": trace.cached_tokens}
        body.pop("kv_transfer_params", None)
        elapsed = time.perf_counter() - trace.start
        self.metrics.ttft.observe(elapsed)
        self.metrics.e2e.observe(elapsed)
        return Response(dumps(body), media_type="application/json", headers=trace_headers(trace))

    async def _relay(self, trace: Trace, req, body: dict, worker: WorkerState, resp: WorkerResponse,
                     ctx: RoutingContext, states: list[WorkerState], tried: set[str], leg: Leg
                     ) -> AsyncIterator[bytes]:
        """Relay the stream; if its decode worker fails mid-stream, migrate it to another decode worker
        (router/migration.py) and keep relaying, so the client sees one unbroken stream. Only when no
        worker can continue does it end with an SSE error event, then [DONE].

        Health outcome per worker: success only with [DONE]; an upstream failure is a failure; a
        client that leaves is neither. `trace.outcome`: ok, error, or cancelled (the client left).
        """
        stream = RelayedStream(keep_token_ids=req.return_token_ids)
        adopted = trace.kv_transfer_params is not None      # a P/D leg's first token came from the prefill worker
        trace.outcome = "cancelled"
        try:
            while True:
                try:
                    async for piece in self._pump(trace, worker, resp, stream, leg):
                        yield piece
                    trace.outcome = "error" if stream.errors else "ok"
                    return
                except UpstreamError as err:
                    log.warning("decode stream %s failed mid-stream on %s (%s): %s", trace.request_id,
                                worker.worker_id, err.reason, err)
                    self.metrics.leg_failures.labels(leg="decode", reason=err.reason).inc()
                    moved = await self._migrate(trace, body, stream, adopted, ctx, states, tried) \
                        if stream.resumable else None
                    if moved is None:
                        if stream.finished:                 # every token was delivered; only the tail was lost
                            trace.outcome = "ok"
                            yield SSE_DONE
                            return
                        trace.outcome = "error"
                        self.metrics.stream_errors.inc()
                        yield sse_error(502, f"the decode worker failed mid-stream: {err.reason}", "upstream_error",
                                        "decode_failed")
                        yield SSE_DONE
                        return
                    worker, resp, leg = moved
        finally:
            self.metrics.e2e.observe(time.perf_counter() - trace.start)
            self.metrics.requests.labels(endpoint=trace.endpoint, decision=trace.decision, outcome=trace.outcome).inc()

    async def _migrate(self, trace: Trace, body: dict, stream: RelayedStream, adopted: bool, ctx: RoutingContext,
                       states: list[WorkerState], tried: set[str]):
        """Open the continuation on another decode worker: (worker, response), or None if none can."""
        continuation = continuation_body(body, stream, adopted)
        try:
            worker, resp, leg = await self._open_with_retries(trace, continuation, True,
                                                              self._pick(ctx, states, tried), ctx, states, tried)
        except (UpstreamError, NoWorkerAvailable) as exc:
            log.warning("stream %s could not be migrated: %s", trace.request_id, exc)
            self.metrics.migrations.labels(outcome="failed").inc()
            return None
        log.info("stream %s migrated to %s after %d tokens", trace.request_id, worker.worker_id, len(stream.token_ids))
        self.metrics.migrations.labels(outcome="ok").inc()
        stream.restart()
        return worker, resp, leg

    async def _pump(self, trace: Trace, worker: WorkerState, resp: WorkerResponse,
                    stream: RelayedStream, leg: Leg) -> AsyncIterator[bytes]:
        """Relay one upstream until [DONE]; a cut, silent or truncated upstream raises UpstreamError.
        Always closes the response and ends the worker's `begin`."""
        outcome, last_at = None, None
        try:
            # the idle timeout is the client's read bound (set in `_open`): a wait_for per chunk
            # cost a task and a timer per streamed token
            async for chunk in resp.iter_any():
                now = time.perf_counter()
                if last_at is None:
                    self.registry.ledger.settle(leg)         # the prompt is computed: the first token is out
                    if not stream.continuation:
                        self.metrics.ttft.observe(now - trace.start)
                else:
                    self.metrics.tpot.observe(now - last_at)
                last_at = now
                errors = stream.errors
                out = stream.feed(chunk)
                if stream.errors > errors:
                    self.metrics.stream_errors.inc(stream.errors - errors)
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
            self.registry.ledger.settle(leg, calibrate=False)   # no-op once the first chunk settled it
            if outcome:
                resp.release()
            else:
                resp.close()                          # client gone or failed: D sees the disconnect and aborts
            self.registry.end(worker.worker_id, outcome)

    # ---- helpers --------------------------------------------------------------------------------
    async def release_prefill(self, trace: Trace) -> None:
        """A prefill state that no decode worker received is released now instead of at lease expiry."""
        ktp = trace.kv_transfer_params
        if ktp is None or trace.decode_connected or not trace.prefill_worker:
            return
        if self.registry.is_vllm(trace.prefill_worker):
            return           # /internal/kv/release is ours; vLLM frees the blocks at its own timeout
        info = self.registry.all_infos().get(trace.prefill_worker)
        if info is None or not self.admin_token:
            return
        try:
            resp = await self.client.post(f"{info.url}/internal/kv/release",
                                          json={"request_id": ktp.remote_request_id},
                                          headers={ADMIN_HEADER: f"Bearer {self.admin_token}"},
                                          timeout=self.s.connect_timeout_s)
            released = resp.status_code == 200 and resp.json().get("released") is True
            self.metrics.prefill_releases.labels(outcome="released" if released else "not_held").inc()
            if resp.status_code != 200:
                log.warning("prefill worker refused to release %s: %s", trace.request_id, resp.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            self.metrics.prefill_releases.labels(outcome="failed").inc()
            log.warning("could not release prefill state of %s: %s", trace.request_id, exc)

    def _origin(self, worker: WorkerState) -> Origin:
        return self.session.origin(worker.info.url)

    def _headers(self, trace: Trace, worker: WorkerState) -> dict[str, str]:
        auth = self._vllm_auth if self.registry.is_vllm(worker.worker_id) else self._auth
        return {"x-request-id": trace.request_id, **auth}
