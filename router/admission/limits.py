"""Per-tenant requests- and tokens-per-minute, one limit for every router replica (docs/admission.md).

Each limit is a token bucket in the state store (`shared.store.buckets`: one Lua script per request,
atomic, all buckets or none): the bucket holds a minute's worth and refills continuously. A request
takes 1 request and `prompt + max_tokens` tokens at admission (vLLM counts prompt and completion
tokens; the completion is not known yet, so its bound is reserved), and is settled at its end: what
it reserved but did not generate goes back. Over a limit: 429 with `Retry-After` and OpenAI's
`x-ratelimit-*` headers.

Store down: each replica keeps serving with buckets of its own holding 1/N of each limit (N: the
replicas the store last counted), and says so (`kimi_pd_router_ratelimit_local` = 1). It goes back
to the store when the store answers the next heartbeat.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from router.admission.tenants import Tenant
from shared.openai.errors import OpenAIError
from shared.store.base import StoreError
from shared.store.buckets import BucketResult, BucketSpec, BucketStore, LocalBuckets

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0


class Throttled(OpenAIError):
    """429 (a tenant's limit) or 503 (the fleet's queue), with headers the client's retry logic reads."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, headers: dict[str, str], *, status: int = 429, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message, status=status, code=code, type=type)
        self.headers = headers


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


@dataclass
class Grant:
    """What one admitted request holds of its tenant's limits, until `RateLimiter.settle`."""

    tenant: Tenant
    reserved_completion: int = 0
    headers: dict[str, str] | None = None
    settled: bool = False


class RateLimiter:
    def __init__(self, store: object | None, router_id: str, metrics=None) -> None:
        self.store = store if isinstance(store, BucketStore) else None
        self.router_id, self.metrics = router_id, metrics
        self.local = LocalBuckets()
        self.replicas = 1                        # the split of each limit while the store is down
        self.store_ok = self.store is not None

    @property
    def mode(self) -> str:
        return "store" if self.store is not None and self.store_ok else "local"

    def _specs(self, tenant: Tenant, requests: float, tokens: float) -> list[BucketSpec]:
        share = 1.0 if self.mode == "store" else 1.0 / max(1, self.replicas)
        specs = []
        for kind, per_minute, cost in (("requests", tenant.rpm, requests), ("tokens", tenant.tpm, tokens)):
            if per_minute is not None:
                cap = per_minute * share
                specs.append(BucketSpec(f"{tenant.name}:{kind}", cap, cap / 60.0, cost))
        return specs

    async def _take(self, specs: list[BucketSpec], force: bool) -> BucketResult:
        if self.store is not None and self.store_ok:
            start = time.perf_counter()
            try:
                result = await self.store.take_buckets(specs, force)
                if self.metrics is not None:
                    self.metrics.ratelimit_store_seconds.observe(time.perf_counter() - start)
                return result
            except StoreError as exc:
                log.warning("rate limits: the store failed (%s); serving with local limits of 1/%d each",
                            type(exc).__name__, self.replicas)
                self._set_store_ok(False)
                specs = self._rescale(specs)
        return self.local.take(specs, force)

    def _rescale(self, specs: list[BucketSpec]) -> list[BucketSpec]:
        n = max(1, self.replicas)
        return [BucketSpec(s.name, s.capacity / n, s.rate_per_s / n, s.cost) for s in specs]

    async def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Grant:
        """Take the tenant's share of its limits for one request, or raise `Throttled` (429)."""
        grant = Grant(tenant, reserved_completion=max_tokens)
        if not tenant.limited:
            return grant
        cost = prompt_tokens + max_tokens
        if tenant.tpm is not None and cost > tenant.tpm:
            raise Throttled(f"Request too large for tenant {tenant.name}: {cost} tokens (prompt + max_tokens) "
                            f"are more than its limit of {tenant.tpm} tokens per minute; send fewer tokens.",
                            {}, type="tokens")
        specs = self._specs(tenant, 1, cost)
        result = await self._take(specs, force=False)
        headers = self._headers(tenant, specs, result)
        if not result.allowed:
            kind = "requests" if tenant.rpm is not None and result.levels[0] < 1 else "tokens"
            headers["retry-after"] = str(max(1, math.ceil(result.wait_s)))
            limit = tenant.rpm if kind == "requests" else tenant.tpm
            raise Throttled(f"Rate limit reached for tenant {tenant.name} on {kind} per minute: limit {limit}. "
                            f"Please try again in {duration(result.wait_s)}.", headers, type=kind)
        grant.headers = headers
        return grant

    async def settle(self, grant: Grant, completion_tokens: int | None) -> None:
        """Give back what the request reserved and did not generate (or take what it used beyond that)."""
        if grant.settled or grant.tenant.tpm is None:
            grant.settled = True
            return
        grant.settled = True
        used = completion_tokens if isinstance(completion_tokens, int) else grant.reserved_completion
        delta = used - grant.reserved_completion
        if delta:
            await self._take(self._specs(grant.tenant, 0, delta)[-1:], force=True)

    def _headers(self, tenant: Tenant, specs: list[BucketSpec], result: BucketResult) -> dict[str, str]:
        out = {}
        for spec, level in zip(specs, result.levels, strict=True):
            kind = spec.name.rsplit(":", 1)[1]
            limit = tenant.rpm if kind == "requests" else tenant.tpm
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(level)))
            out[f"x-ratelimit-reset-{kind}"] = duration(max(0.0, spec.capacity - level) / spec.rate_per_s)
        return out

    def _set_store_ok(self, ok: bool) -> None:
        if ok != self.store_ok:
            log.warning("rate limits: %s", "back on the shared store" if ok else
                        f"store unreachable: local limits of 1/{self.replicas} each")
        self.store_ok = ok
        if self.metrics is not None:
            self.metrics.ratelimit_local.set(0 if ok else 1)

    async def heartbeat(self) -> None:
        """Count the live replicas (the split used while the store is down); come back to the store."""
        if self.store is None:
            return
        try:
            self.replicas = await self.store.router_heartbeat(self.router_id, 3 * HEARTBEAT_S)
            self._set_store_ok(True)
        except StoreError:
            self._set_store_ok(False)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
