"""The router's view of the fleet: static + discovered workers, their load, health and caches.

Discovered workers come from the state store; each refresh replaces the registry with the store's
list. If the store is unreachable, the last known list is kept (routing degrades, it never stops),
and refreshes resume when it returns. KV events feed an exact prefix index per worker: a late
router loads each worker's snapshot, then the events after it; a gap in sequence numbers (a
trimmed or restarted stream) means reloading from the next snapshot. Static workers (e.g. stock
vLLM) have no events: an approximate index of what this router sent them stands in, sized from
each worker's cache capacity (its registration, `--static-cache-tokens`, or its /metrics).

Load as placement reads it: the engine's last report corrected by this replica's sends and
finishes since the report was sampled, and a ledger of the prefill work still open per worker. For
static workers, which report to no store, the other router replicas' in-flight legs and open work
are added, shared through the store when there is one (`_share_load`), so replicas place as one.
A static worker given with data-parallel ranks is one worker per rank (`<URL>#dp<r>`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from router.connectors import CONNECTORS, Connector, connector
from router.placement.health import HealthTracker
from router.placement.kv_pool import KVPool
from router.placement.ledger import LedgerConfig, Leg, WorkLedger
from router.placement.prefix_index import ApproximatePrefixIndex, PrefixIndex
from router.placement.transfer import TransferCostConfig, TransferCosts
from router.placement.types import WorkerState
from router.settings import RouterSettings
from shared.hashing import root_hash
from shared.store.base import StateStore, WorkerRecord
from shared.workers import LoadReport, Role, WorkerInfo


class Siblings(Protocol):
    """What the registry asks of the router's sibling processes (`--workers N`; router/procs/share.py's
    ProcessShare implements it): the registry stays below the process layer that attaches to it."""

    def catch_up(self) -> None: ...

    def peers(self) -> dict[str, tuple[int, float]]: ...

    def publish(self, worker_id: str) -> None: ...

    def added_static(self, url: str, role: str, kv_connector: str | None) -> None: ...

    def drained(self, worker_id: str) -> None: ...


log = logging.getLogger(__name__)
REFUSAL = ("static workers answer as stock vLLM, not as kimi-pd workers: {urls}. Start the router with the "
           "--kv-connector of their KV connector (mooncake-ascend for vLLM-Ascend's MooncakeConnectorV1; nixl, "
           "mooncake, lmcache or example): they then get vLLM's P/D protocol and none of kimi-pd's internal calls")


def dp_worker_ids(url: str, ranks: int | None) -> list[str]:
    """The worker ids of a static URL: itself, or one per data-parallel rank behind its API server."""
    return [url] if ranks is None else [f"{url}#dp{r}" for r in range(ranks)]


_NO_PEERS = (0, 0.0)


class CombinedIndex:
    """Exact index for workers that publish events, approximate for the rest."""

    def __init__(self, approximate_blocks: int) -> None:
        self.exact = PrefixIndex()
        self.approximate = ApproximatePrefixIndex(approximate_blocks)
        self.exact_workers: set[str] = set()
        self.on_sent: Callable[[str, Sequence[int]], None] | None = None   # router processes: tell the siblings

    def matched_blocks(self, worker_id: str, hashes) -> int:
        index = self.exact if worker_id in self.exact_workers else self.approximate
        return index.matched_blocks(worker_id, hashes)

    def record_sent(self, worker_id: str, hashes) -> None:
        if worker_id not in self.exact_workers:
            self.approximate.record(worker_id, hashes)
            if self.on_sent is not None:
                self.on_sent(worker_id, hashes)

    def size_for(self, info: WorkerInfo, capacity_tokens: int) -> None:
        """Bound the approximate entry of a worker to its cache (no-op when the size is unknown)."""
        if capacity_tokens >= info.block_size > 0:
            self.approximate.set_capacity(info.worker_id, capacity_tokens // info.block_size)


class _SinceReport:
    """This replica's begins (+1) and ends (-1) on one worker, newest last, with their sum; entries
    older than the worker's latest load report are dropped as they stop mattering, and so are those
    older than `MAX_AGE_S` or beyond `MAX_EVENTS` (a static worker never reports: without these bounds
    its events grew with every request)."""

    __slots__ = ("events", "total")
    MAX_EVENTS = 8192
    MAX_AGE_S = 60.0                                  # a load report older than this is long stale

    def __init__(self) -> None:
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, now: float, sign: int) -> None:
        events = self.events
        events.append((now, sign))
        self.total += sign
        while len(events) > self.MAX_EVENTS or events[0][0] < now - self.MAX_AGE_S:
            self.total -= events.popleft()[1]

    def after(self, ts: float) -> int:
        events = self.events
        while events and events[0][0] <= ts:
            self.total -= events.popleft()[1]
        return self.total


class WorkerRegistry:
    def __init__(self, settings: RouterSettings, store: StateStore | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings, self.store, self._clock = settings, store, clock
        self.static: dict[str, WorkerInfo] = self._static_workers(settings)
        # worker -> the data-parallel rank it pins (X-data-parallel-rank)
        self.dp_ranks: dict[str, int] = {wid: r for url, d in settings.static_dp_ranks
                                         for r, wid in enumerate(dp_worker_ids(url, d))}
        # each static worker's P/D protocol (a pool: workers given with one --kv-connector, or added by
        # the admin API with theirs); discovered workers are ours ("kimi-pd")
        self.static_connectors: dict[str, Connector] = {url: connector(settings.kv_connector) for url in self.static}
        self.mooncake_engines: dict[str, str] = {}    # prefill worker -> engine id (its bootstrap /query)
        self.discovered: dict[str, WorkerInfo] = {}
        self.loads: dict[str, LoadReport] = {}
        self.inflight: dict[str, int] = {}
        self.drained: set[str] = set()
        self.health = HealthTracker()
        self.index = CombinedIndex(settings.approximate_index_blocks)
        pool = settings.kv_pool
        self.pool: KVPool | None = KVPool(pool) if pool.enabled else None     # shared by the prefill workers
        self._pooling: dict[int, Sequence[int]] = {}      # open leg -> the prompt it saves to the pool when answered
        self.on_pooled: Callable[[Sequence[int]], None] | None = None      # router processes: tell the siblings
        self.ledger = WorkLedger(LedgerConfig(tokens_per_s=settings.prefill_tokens_per_s), clock)
        self.transfer = TransferCosts(TransferCostConfig(enabled=settings.transfer_aware))
        self._since: dict[str, _SinceReport] = {}
        self._event_seq: dict[str, int] = {}
        self.store_ok = store is None
        self._empty_since: float | None = None
        self._instance: str | None = None            # the store server's run id, to notice restarts
        self.router_id = secrets.token_hex(8)         # this replica, in the load it shares (_share_load)
        self.sibling_prefix = ""                      # `--workers N`: the router ids of this router's processes
        self.peers: dict[str, tuple[int, float]] = {}   # static worker -> other replicas' (in-flight, backlog s)
        self.unsized: set[str] = set()                # static workers whose /metrics are still to be asked
        self.load_scrapes: dict[str, asyncio.Task] = {}   # stock vLLM /metrics reads under way (health_checker)
        # what a static worker declared ours proved to be (health_checker.identify): "kimi-pd" (its /health
        # names its role and id) gets internal credentials; "vllm" (it answers as stock vLLM) is refused
        self.identities: dict[str, str] = {}
        # `--workers N`: the sibling router processes' load, sends and admin changes (router/procs/share.py)
        self.share: Siblings | None = None
        for info in self.static.values():
            self._size_static(info)

    @staticmethod
    def static_info(s: RouterSettings, url: str, role: Role, worker_id: str | None = None) -> WorkerInfo:
        """A worker given by URL (command line or admin API): no events, the router's own hash chain."""
        return WorkerInfo(worker_id=worker_id or url, role=role, url=url.rstrip("/"), model_id=s.served_model_name,
                          block_size=s.block_size, hash_root=root_hash(s.served_model_name), started_at=time.time())

    @classmethod
    def _static_workers(cls, s: RouterSettings) -> dict[str, WorkerInfo]:
        """One worker per URL, or per data-parallel rank behind it (`<URL>#dp<r>`, settings.static_dp_ranks)."""
        pools: tuple[tuple[Role, tuple[str, ...]], ...] = (
            ("prefill", s.static_prefill), ("decode", s.static_decode), ("both", s.static_both))
        ranks = dict(s.static_dp_ranks)
        return {wid: cls.static_info(s, url, role, wid) for role, urls in pools for url in urls
                for wid in dp_worker_ids(url, ranks.get(url))}

    # ---- views --------------------------------------------------------------------------------
    def open_leg(self, info: WorkerInfo, tokens: int, prompt_hashes: Sequence[int] = ()) -> Leg:
        """A leg of `tokens` prefill work sent to the worker, in the work ledger. When the worker computes a prompt
        (`tokens` > 0) and shares the KV pool, the prompt's blocks join the pool once the leg is answered
        (`settle_leg`): only then has the worker saved them."""
        leg = self.ledger.open(info.worker_id, tokens)
        if tokens > 0 and prompt_hashes and self.pool is not None and self.pool.member(info.role):
            self._pooling[leg.leg_id] = prompt_hashes
        return leg

    def settle_leg(self, leg: Leg, calibrate: bool = True) -> None:
        """The leg is answered (`calibrate`: its prompt was computed) or gave up; its work leaves the ledger."""
        self.ledger.settle(leg, calibrate=calibrate)
        hashes = self._pooling.pop(leg.leg_id, None)
        if hashes is not None and calibrate and self.pool is not None:
            self.pool.record(hashes)
            if self.on_pooled is not None:
                self.on_pooled(hashes)

    def all_infos(self) -> dict[str, WorkerInfo]:
        return {**self.static, **self.discovered}

    def states(self) -> list[WorkerState]:
        """Every worker as placement sees it now. Built per request for the whole fleet, so the loop
        reads each table once per worker through bound lookups (benchmarks/placement_cost.py)."""
        siblings: dict[str, tuple[int, float]] = {}
        if self.share is not None:                   # sibling processes: their sends and load, now
            self.share.catch_up()
            siblings = self.share.peers()
        load_of, since_of, peer_of, inflight_of = self.loads.get, self._since.get, self.peers.get, self.inflight.get
        health_of, drained = self.health.view, self.drained
        ledger_of = self.ledger.view
        out = []
        for wid, info in self.all_infos().items():
            load = load_of(wid)
            since = since_of(wid)
            peer_inflight, peer_backlog_s = peer_of(wid, _NO_PEERS)
            if wid in siblings:
                peer_inflight, peer_backlog_s = (peer_inflight + siblings[wid][0], peer_backlog_s + siblings[wid][1])
            healthy, circuit = health_of(wid)
            backlog_s, tokens_per_s = ledger_of(wid)
            out.append(WorkerState(               # in field order: keywords double a state's cost
                info, load, inflight_of(wid, 0) + peer_inflight, healthy, circuit, wid in drained,
                since.after(load.ts) if since is not None and load is not None else 0,
                backlog_s + peer_backlog_s, tokens_per_s))
        return out

    def add_static(self, url: str, role: Role, kv_connector: str | None = None, local: bool = True) -> None:
        """Add a static worker (admin API); `local`: made here, so sibling processes are told."""
        if local and self.share is not None:
            self.share.added_static(url, role, kv_connector)
        self.static[url] = info = self.static_info(self.settings, url, role)
        self.static_connectors[url] = connector(kv_connector or self.settings.kv_connector)
        self.mooncake_engines.pop(url, None)
        self.identities.pop(url, None)
        self._size_static(info)

    def connector_of(self, worker_id: str) -> Connector:
        """The P/D protocol a worker speaks (a worker known nowhere is treated as ours)."""
        return self.static_connectors.get(worker_id) or CONNECTORS["kimi-pd"]

    def hash_chain(self, worker_id: str) -> tuple[int, int]:
        """(hash root, block size) placement hashes a worker's prompts with."""
        info = self.all_infos()[worker_id]
        return info.hash_root, info.block_size

    def is_vllm(self, worker_id: str) -> bool:
        return self.connector_of(worker_id).vllm

    def is_proven(self, worker_id: str) -> bool:
        """Whether internal credentials (admin token, /internal/ calls) may go to the worker: it registered
        through the authenticated store, or it is a static worker of ours that passed the identity check."""
        return worker_id in self.discovered or self.identities.get(worker_id) == "kimi-pd"

    def refused(self) -> str | None:
        """What the operator must do about static workers declared ours that answer as stock vLLM (None: none)."""
        urls = {self.static[wid].url: None for wid, kind in self.identities.items()     # ordered, each URL once
                if kind == "vllm" and wid in self.static}
        return REFUSAL.format(urls=", ".join(urls)) if urls else None

    def _size_static(self, info: WorkerInfo) -> None:
        if self.settings.static_cache_tokens:
            self.index.size_for(info, self.settings.static_cache_tokens)
        else:
            self.unsized.add(info.worker_id)

    def record_check(self, worker_id: str, ok: bool) -> bool:
        """Feed one health check to the tracker; True when the worker's health changed."""
        was = self.health.is_healthy(worker_id)
        self.health.record_check(worker_id, ok)
        if ok and not was:
            self.mooncake_engines.pop(worker_id, None)    # a restarted prefill has a new engine id
        return was != self.health.is_healthy(worker_id)

    def begin(self, worker_id: str) -> None:
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1
        self._since.setdefault(worker_id, _SinceReport()).add(self._clock(), 1)
        if self.share is not None:
            self.share.publish(worker_id)

    def end(self, worker_id: str, ok: bool | None) -> None:
        """Close a `begin`. ok=None (the client left, we cancelled) records no health outcome."""
        self.inflight[worker_id] = max(0, self.inflight.get(worker_id, 0) - 1)
        self._since.setdefault(worker_id, _SinceReport()).add(self._clock(), -1)
        if self.share is not None:
            self.share.publish(worker_id)
        if ok is not None:
            self.health.record_outcome(worker_id, ok)

    # ---- refresh from the store -----------------------------------------------------------------
    async def refresh(self) -> None:
        store = self.store
        if store is None:
            return
        try:
            records = await store.workers()
            if await self._store_restarted_empty(store, records):
                return
            gone = set(self.discovered) - {r.info.worker_id for r in records} - set(self.static)
            self.discovered = {r.info.worker_id: r.info for r in records}
            self.loads.update({r.info.worker_id: r.load for r in records})
            for r in records:
                self.index.size_for(r.info, r.load.capacity_tokens or r.info.capacity_tokens)
            for wid in gone:
                self._forget(wid)
            for wid in self.discovered:
                await self._sync_events(store, wid)
            await self._share_load(store)
            if not self.store_ok:
                log.info("state store reachable again; registry rebuilt (%d workers)", len(self.discovered))
            self.store_ok = True
        except Exception as exc:                             # noqa: BLE001 - keep routing on the last known state
            if self.store_ok:
                log.warning("state store unavailable, routing on the last known state: %s", exc)
            self.store_ok = False

    async def _share_load(self, store: StateStore) -> None:
        """Static workers report to no store, so router replicas share what they sent them (in-flight legs,
        open work in seconds) through it: each adds the others' to its own, and replicas place as one."""
        if not self.static:
            return
        mine = {wid: [self.inflight.get(wid, 0), round(self.ledger.backlog_s(wid), 4)] for wid in self.static}
        others = await store.share_router_load(self.router_id, mine, max(4 * self.settings.refresh_s, 2.0))
        peers: dict[str, tuple[int, float]] = {}
        for router_id, loads in others.items():
            if self.sibling_prefix and router_id.startswith(self.sibling_prefix):
                continue                             # a process of this router: read live from the table

            for wid, (inflight, backlog_s) in loads.items():
                if wid in self.static:
                    had = peers.get(wid, (0, 0.0))
                    peers[wid] = (had[0] + int(inflight), had[1] + float(backlog_s))
        self.peers = peers

    async def _store_restarted_empty(self, store: StateStore, records: list[WorkerRecord]) -> bool:
        """A store that lists nobody right after an outage, or whose server instance changed, has
        restarted empty: workers register again with their next heartbeat. Until then (at most
        `store_empty_grace_s`) keep the last fleet, so the restart costs no request a 503. An empty
        list from the same, reachable store is real (every worker deregistered)."""
        instance = await store.instance_id()
        restarted = (not self.store_ok) or (instance is not None and self._instance not in (None, instance))
        self._instance = instance
        if records or not self.discovered:
            self._empty_since = None
            return False
        if self._empty_since is None and not restarted:
            return False
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
            log.warning("state store lists no workers (restarted empty?); routing on the last %d known for up to "
                        "%.0f s", len(self.discovered), self.settings.store_empty_grace_s)
        return now - self._empty_since < self.settings.store_empty_grace_s

    def _forget(self, worker_id: str) -> None:
        """Drop everything known about a worker that left (so worker churn does not grow memory)."""
        self._forget_events(worker_id)
        self.loads.pop(worker_id, None)
        self.inflight.pop(worker_id, None)
        self.drained.discard(worker_id)
        self.health.forget(worker_id)
        self.index.approximate.drop_worker(worker_id)
        self.ledger.forget(worker_id)
        self.transfer.forget(worker_id)
        self._since.pop(worker_id, None)

    def _forget_events(self, worker_id: str) -> None:
        self._event_seq.pop(worker_id, None)
        self.index.exact.drop_worker(worker_id)
        self.index.exact_workers.discard(worker_id)

    async def _sync_events(self, store: StateStore, worker_id: str) -> None:
        seq = self._event_seq.get(worker_id)
        if seq is None:
            snap = await store.read_kv_snapshot(worker_id)
            if snap is None:
                return
            seq, hashes = snap
            self.index.exact.load_snapshot(worker_id, hashes)
            self.index.exact_workers.add(worker_id)
        batches = await store.read_kv_events(worker_id, after=seq)
        for number, batch in batches:
            if number != seq + 1:                    # gap: the stream was trimmed or restarted
                self._forget_events(worker_id)
                return
            self.index.exact.apply(worker_id, batch)
            seq = number
        self._event_seq[worker_id] = seq

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.refresh_s)

    def drain(self, worker_id: str, local: bool = True) -> bool:
        """Stop placing on the worker; `local`: asked here, so sibling processes are told."""
        if worker_id not in self.all_infos():
            return False
        if local and self.share is not None:
            self.share.drained(worker_id)
        self.drained.add(worker_id)
        return True

    def snapshot(self) -> list[dict]:
        out = []
        for s in self.states():
            out.append({"worker_id": s.info.worker_id, "role": s.info.role, "url": s.info.url,
                        "model": s.info.model_id, "source": "static" if s.info.worker_id in self.static else "store",
                        "healthy": s.healthy, "circuit": s.circuit.value, "draining": s.is_draining,
                        "kv_connector": self.connector_of(s.info.worker_id).name,
                        "proven": self.is_proven(s.info.worker_id),
                        "inflight": s.inflight, "active_requests": s.active_requests,
                        "backlog_s": round(s.backlog_s, 4), "tokens_per_s": round(s.tokens_per_s, 1),
                        "load": None if s.load is None else s.load.to_dict(),
                        "cached_blocks": self.index.exact.num_blocks(s.info.worker_id)
                        if s.info.worker_id in self.index.exact_workers
                        else self.index.approximate.num_blocks(s.info.worker_id)})
        return out

