"""Active health checks: GET /health on every known worker, feeding the HealthTracker."""
from __future__ import annotations

import asyncio
import logging

import httpx

from router.registry import WorkerRegistry

log = logging.getLogger(__name__)


async def check_once(client: httpx.AsyncClient, registry: WorkerRegistry, timeout_s: float) -> None:
    infos = list(registry.all_infos().values())

    async def probe(info) -> None:
        try:
            resp = await client.get(f"{info.url}/health", timeout=timeout_s)
            ok = resp.status_code == 200
        except Exception:                                  # noqa: BLE001 - any failure is a failed check
            ok = False
        was = registry.health.is_healthy(info.worker_id)
        registry.health.record_check(info.worker_id, ok)
        if was != registry.health.is_healthy(info.worker_id):
            log.warning("worker %s is now %s", info.worker_id, "healthy" if ok else "unhealthy")

    await asyncio.gather(*(probe(i) for i in infos))


async def run(client: httpx.AsyncClient, registry: WorkerRegistry, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await check_once(client, registry, min(interval_s, 2.0))
        except Exception:                                  # noqa: BLE001 - the checker must outlive any bug
            log.exception("health check round failed")
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
