"""Active health checks: GET /health on every known worker, feeding the HealthTracker."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from router.capacity import capacity_tokens_from_metrics
from router.metrics import RouterMetrics
from router.registry import REFUSAL, WorkerRegistry
from router.vllm_metrics import load_from_vllm_metrics, timing_deltas

log = logging.getLogger(__name__)

# a stock vLLM worker's /metrics is read off the health round, one read per worker at a time, given
# this long as a whole: the page of an API server busy streaming to a dozen clients came in pieces
# over 10-30 s here (a late page is still the newest load there is), and inline it held every worker's
# health check for as long
LOAD_SCRAPE_DEADLINE_S = 60.0


async def get_within(client: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response:
    """GET with `timeout_s` for the whole exchange: httpx's timeout bounds each read, so an answer
    sent in slow pieces (see LOAD_SCRAPE_DEADLINE_S) would otherwise hold its caller much longer."""
    return await asyncio.wait_for(client.get(url, timeout=timeout_s), timeout_s)


async def check_once(client: httpx.AsyncClient, registry: WorkerRegistry, timeout_s: float,
                     metrics: RouterMetrics | None = None, wait_for_load: bool = True) -> dict[str, bool]:
    """One health round; returns each worker's check. `wait_for_load`: read stock vLLM workers' load inline
    (at startup, so the router is ready with it); otherwise in the background (`scrape_load`), never
    holding the round."""
    infos = list(registry.all_infos().values())
    results: dict[str, bool] = {}

    async def probe(info) -> None:
        answered = False
        try:
            resp = await get_within(client, f"{info.url}/health", timeout_s)
            ok = answered = resp.status_code == 200
            if ok and info.worker_id in registry.static and not registry.is_vllm(info.worker_id):
                ok = await identify(client, registry, info, resp, timeout_s)
        except Exception:                                  # noqa: BLE001 - any failure is a failed check
            ok = False
        if not answered:
            registry.identities.pop(info.worker_id, None)   # whatever answers next at that URL proves itself again
        if ok and registry.is_vllm(info.worker_id):
            scrape = scrape_load(client, registry, info, metrics,                    # sizes its index too
                                 timeout_s if wait_for_load else LOAD_SCRAPE_DEADLINE_S)
            if wait_for_load and scrape is not None:
                await scrape
        elif ok and info.worker_id in registry.unsized:
            await size_from_metrics(client, registry, info, timeout_s)
        results[info.worker_id] = ok
        if registry.record_check(info.worker_id, ok):
            log.warning("worker %s is now %s", info.worker_id, "healthy" if ok else "unhealthy")

    await asyncio.gather(*(probe(i) for i in infos))
    return results


def round_record(registry: WorkerRegistry, results: dict[str, bool]) -> list[list]:
    """What sibling router processes need of a round (`--workers N`: only process 0 probes): per worker its
    check, its identity, a stock vLLM worker's scraped load and its approximate index's size."""
    sized = registry.index.approximate
    return [[wid, ok, registry.identities.get(wid),
             registry.loads[wid].to_dict() if registry.is_vllm(wid) and wid in registry.loads else None,
             sized.capacity(wid) if wid not in registry.unsized and wid in registry.static else None]
            for wid, ok in results.items()]


async def identify(client: httpx.AsyncClient, registry: WorkerRegistry, info, health: httpx.Response,
                   timeout_s: float) -> bool:
    """Whether a static worker declared ours may be used. Proven (internal credentials) when its /health
    names its role and id, as a kimi-pd worker's does; refused when it answers GET /version as stock vLLM
    does (a vLLM rank under the default --kv-connector); anything else is used without credentials.
    Asked once per worker while it stays up."""
    known = registry.identities.get(info.worker_id)
    if known is not None:
        return known != "vllm"
    try:
        body = health.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("role"), str) and isinstance(body.get("worker_id"), str):
        registry.identities[info.worker_id] = "kimi-pd"
        return True
    try:
        version = await get_within(client, f"{info.url}/version", timeout_s)
        stock = version.status_code == 200 and isinstance(version.json(), dict) and "version" in version.json()
    except Exception:                                      # noqa: BLE001 - no answer: not stock vLLM
        stock = False
    registry.identities[info.worker_id] = "vllm" if stock else "unknown"
    if stock:
        log.error("%s", REFUSAL.format(urls=info.url))
    return not stock


def scrape_load(client: httpx.AsyncClient, registry: WorkerRegistry, info, metrics: RouterMetrics | None = None,
                deadline_s: float = LOAD_SCRAPE_DEADLINE_S) -> asyncio.Task | None:
    """Start reading `info`'s load unless a read of it is still under way (then None)."""
    tasks = registry.load_scrapes
    running = tasks.get(info.worker_id)
    if running is not None and not running.done():
        return None
    tasks[info.worker_id] = task = asyncio.create_task(
        load_from_metrics(client, registry, info, deadline_s, metrics))
    return task


def cancel_scrapes(registry: WorkerRegistry) -> None:
    for task in registry.load_scrapes.values():
        task.cancel()
    registry.load_scrapes.clear()


async def size_from_metrics(client: httpx.AsyncClient, registry: WorkerRegistry, info, timeout_s: float) -> None:
    """Size a static worker's approximate index from its /metrics (asked once per worker)."""
    registry.unsized.discard(info.worker_id)
    try:
        resp = await get_within(client, f"{info.url}/metrics", timeout_s)
        tokens = capacity_tokens_from_metrics(resp.text) if resp.status_code == 200 else None
    except Exception:                                      # noqa: BLE001 - sizing is best effort
        tokens = None
    if tokens:
        registry.index.size_for(info, tokens)
        log.info("worker %s caches %d tokens: approximate index sized to %d blocks", info.worker_id, tokens,
                 registry.index.approximate.capacity(info.worker_id))
    else:
        log.warning("worker %s does not report its cache size; its approximate prefix index keeps %d blocks "
                    "(set --static-cache-tokens)", info.worker_id, registry.index.approximate.capacity_blocks)


async def load_from_metrics(client: httpx.AsyncClient, registry: WorkerRegistry, info, timeout_s: float,
                            metrics: RouterMetrics | None = None) -> None:
    """A stock vLLM worker's load from its /metrics (router/vllm_metrics.py), every health round: the
    heartbeat such a worker does not send. A page that cannot be read keeps the last report."""
    try:
        resp = await get_within(client, f"{info.url}/metrics", timeout_s)
        rank = registry.dp_ranks.get(info.worker_id)              # a DP rank's own engine="<rank>" samples
        report = load_from_vllm_metrics(resp.text, time.time(), None if rank is None else str(rank)) \
            if resp.status_code == 200 else None
    except Exception as exc:                               # noqa: BLE001 - load is best effort
        log.debug("metrics of %s unreadable: %s", info.worker_id, exc)
        return
    if report is None:
        return
    if metrics is not None and info.role in ("decode", "both"):     # what vLLM's answers carry no header for
        for key, (seconds, count) in timing_deltas(registry.loads.get(info.worker_id), report).items():
            histogram = metrics.decode_queue if key == "queue" else metrics.transfer_seconds
            for _ in range(min(count, 10000)):
                histogram.observe(seconds / count)
    registry.loads[info.worker_id] = report
    if info.worker_id in registry.unsized and report.capacity_tokens:
        registry.unsized.discard(info.worker_id)
        registry.index.size_for(info, report.capacity_tokens)
        log.info("worker %s caches %d tokens: approximate index sized to %d blocks", info.worker_id,
                 report.capacity_tokens, registry.index.approximate.capacity(info.worker_id))


async def run(client: httpx.AsyncClient, registry: WorkerRegistry, interval_s: float, stop: asyncio.Event,
              metrics: RouterMetrics | None = None, timeout_s: float = 2.0,
              publish: Callable[[list[list]], None] | None = None) -> None:
    """A round every `interval_s` after the last one ended (rounds never overlap), each probe given
    `timeout_s`: a short interval (fast failure detection) does not shorten the time a busy worker
    has to answer, which on a starved host made healthy workers look dead. `publish`: hand each round
    to the sibling router processes (`round_record`)."""
    try:
        while not stop.is_set():
            try:
                results = await check_once(client, registry, timeout_s, metrics, wait_for_load=False)
                if publish is not None:
                    publish(round_record(registry, results))
            except Exception:                              # noqa: BLE001 - the checker must outlive any bug
                log.exception("health check round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        cancel_scrapes(registry)
