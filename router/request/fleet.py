"""What every leg of a request needs of the router, built once: settings, the registry (health, ledger,
prefix index), placement, the pooled worker client with its timeouts and auth headers, and metrics."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from router.metrics import RouterMetrics
from router.placement.pipeline import Pipeline
from router.placement.types import RoutingContext, WorkerState
from router.registry import WorkerRegistry
from router.request.trace import Trace
from router.settings import RouterSettings
from router.transport.upstream import LegTimeout, UpstreamError, leg_timeout
from router.transport.worker_http import Origin, WorkerClient
from shared.openai.ids import GROUP_HEADER

T = TypeVar("T")


class Fleet:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, client: httpx.AsyncClient,
                 pipeline: Pipeline, metrics: RouterMetrics, admin_token: str | None,
                 session: WorkerClient) -> None:
        self.s, self.registry, self.client, self.session = settings, registry, client, session
        self.pipeline, self.metrics, self.admin_token = pipeline, metrics, admin_token
        # what the Mooncake connector reads (router.connectors.BootstrapLookup)
        self.engines = registry.mooncake_engines
        self.bootstrap_port, self.connect_timeout_s = settings.mooncake_bootstrap_port, settings.connect_timeout_s
        # built once, not per leg: timeouts, the auth header, parsed worker URLs
        self.timeouts: dict[str, LegTimeout] = {kind: leg_timeout(settings.connect_timeout_s, read) for kind, read in (
            ("prefill", settings.prefill_timeout_s), ("stream", settings.idle_timeout_s),
            ("whole", settings.decode_timeout_s))}
        token = settings.worker_api_key or (admin_token if settings.api_keys else None)
        # with client keys on, our workers only serve authenticated callers (our admin token); a worker not
        # proven ours (stock vLLM, or a static worker that failed the identity check) never sees that token:
        # it gets its own --api-key (KIMI_PD_WORKER_API_KEY) or nothing
        self._auth = {"authorization": f"Bearer {token}"} if token else {}
        vllm_key = settings.worker_api_key
        self._vllm_auth = {"authorization": f"Bearer {vllm_key}"} if vllm_key else {}

    def pick(self, ctx: RoutingContext, states: list[WorkerState], exclude: set[str]) -> WorkerState:
        candidates = [w for w in states if w.worker_id not in exclude]
        return self.pipeline.pick(ctx, candidates).worker         # NoWorkerAvailable is the client's 503

    def record_sent(self, ctx: RoutingContext, worker: WorkerState) -> None:
        """FIFO: what later requests will find cached on `worker`."""
        self.registry.index.record_sent(worker.worker_id, ctx.hashes_for(worker.info))

    def other_pools(self, states: list[WorkerState], kv_connector: str) -> set[str]:
        """Workers that speak another P/D protocol: they can neither hand nor take this request's KV."""
        return {w.worker_id for w in states if self.registry.connector_of(w.worker_id).name != kv_connector}

    def for_worker(self, body: dict) -> dict:
        """Workers know the model by its first served name; clients may use any alias."""
        if body.get("model") in self.s.served_model_aliases:
            body["model"] = self.s.served_model_name
        return body

    def origin(self, worker: WorkerState) -> Origin:
        return self.session.origin(worker.info.url)

    def headers(self, trace: Trace, worker: WorkerState) -> dict[str, str]:
        ours = self.registry.is_proven(worker.worker_id)
        auth = self._auth if ours else self._vllm_auth
        extra = {GROUP_HEADER: trace.group} if trace.group and ours else {}   # our header, to our workers only
        rank = self.registry.dp_ranks.get(worker.worker_id)
        if rank is not None:                 # one of the data-parallel ranks behind one vLLM API server
            extra["x-data-parallel-rank"] = str(rank)
        return {"x-request-id": trace.request_id, **extra, **auth}

    async def call(self, worker: WorkerState, send: Callable[[], Awaitable[T]]) -> T:
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
