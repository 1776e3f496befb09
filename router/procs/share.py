"""One router process's side of the shared table: what it publishes, what it reads of its siblings.

Placement state shared so that N processes place as one router (docs/router-processes.md):

- load per worker: each process writes its in-flight legs and its ledger's open work (backlog now, the
  floor it falls to once the oldest leg's progress is spent, the time) into its own cells on every
  begin/end/open/settle; `WorkerRegistry.states()` adds the siblings' (one copy of the cells per call);
- the approximate prefix index of static workers: a send is appended to the log, siblings replay it
  before their next placement; exact indexes follow the store's KV events in every process;
- admin changes (added static workers, drains): the log for the live siblings, plus the admin blob that a
  restarted process reads at start;
- transfer costs (`--transfer-aware`): each pull a decode worker reports is a log record, so every
  process prices the next prompt's move from all pulls, not from the ones it happened to route;
- health: process 0 probes; each round's outcome is one log record the others apply;
- admission: each process's queue slots and waiters, read by the others' queues;
- tenant usage: each process's counters in its blob, merged by `/admin/tenants` and the dashboard.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from router.procs.table import SharedTable
from shared.workers import LoadReport

if TYPE_CHECKING:
    from router.registry import WorkerRegistry

log = logging.getLogger(__name__)
SENT, ADD_STATIC, DRAIN, HEALTH, TRANSFER, POOLED = 1, 2, 3, 4, 5, 6
PID, ADM_INFLIGHT, ADM_WAITING, SERVED, READY = 0, 1, 2, 3, 4    # process row fields (table.set_proc)
USAGE_EVERY_S = 0.5
IDLE_TICK_S = 0.25               # placements catch up with the log themselves; this only bounds an idle lag


class ProcessShare:
    """Process `index` of `table.nprocs`; process 0 is the leader (it runs the health checks)."""

    def __init__(self, table: SharedTable, index: int, group: str = "", clock: Callable[[], float] = time.time) -> None:
        self.table, self.index, self.clock = table, index, clock
        self.group = group                                # this router's prefix of router ids in the store
        self.nprocs = table.nprocs
        self._slots: dict[str, int | None] = {}
        self._bases: dict[str, list[int]] = {}
        self._pos = table.log_tail
        self.lapped = 0                                   # log records lost by falling behind
        self.registry: WorkerRegistry | None = None
        table.set_proc(index, PID, _pid())

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def attach(self, registry: WorkerRegistry) -> None:
        """Hook the registry: its load changes are published, its reads add the siblings', and the admin
        changes made before this process started are applied."""
        self.registry = registry
        registry.share = self
        if self.group:                                    # the store's shared view: siblings are read here
            registry.router_id, registry.sibling_prefix = f"{self.group}-{self.index}", f"{self.group}-"
        registry.ledger.on_change = self.publish
        registry.index.on_sent = self.sent
        registry.transfer.on_observe = self.transferred
        registry.on_pooled = self.pooled
        admin = self.table.read_blob(self.nprocs)
        if admin:
            state = msgpack.unpackb(admin)
            for url, role, kind in state["static"]:
                registry.add_static(url, role, kind, local=False)
            for wid in state["drained"]:
                registry.drain(wid, local=False)
        self.catch_up()

    # ---- load -----------------------------------------------------------------------------------
    def _slot(self, worker_id: str) -> int | None:
        if worker_id not in self._slots:
            slot = self._slots[worker_id] = self.table.find_slot(worker_id)
            if slot is None:
                log.warning("router process table full: load on %s is not shared between processes", worker_id)
            else:                                          # where the siblings' cells for it start
                self._bases[worker_id] = [(slot * self.nprocs + p) * 4 for p in range(self.nprocs) if p != self.index]
        return self._slots[worker_id]

    def publish(self, worker_id: str) -> None:
        """Write this process's current load on the worker (after a begin/end or a ledger change)."""
        reg, slot = self.registry, self._slot(worker_id)
        if reg is None or slot is None:
            return
        backlog, floor = reg.ledger.backlog_bounds(worker_id)
        self.table.write_cell(slot, self.index, (float(reg.inflight.get(worker_id, 0)), backlog, floor,
                                                 self.clock()))

    def peers(self) -> dict[str, tuple[int, float]]:
        """The siblings' (in-flight legs, open work in seconds) per worker this process knows, now."""
        cells, now = self.table.cells(), self.clock()
        out: dict[str, tuple[int, float]] = {}
        for wid, bases in self._bases.items():
            inflight, backlog = 0.0, 0.0
            for base in bases:
                stamp = cells[base + 3]
                if stamp:                                  # 0: never written, or being written
                    inflight += cells[base]
                    if cells[base + 1]:
                        backlog += max(cells[base + 2], cells[base + 1] - (now - stamp))
            if inflight or backlog:
                out[wid] = (int(inflight), backlog)
        return out

    def know(self, worker_ids) -> None:
        """Make sure every worker has a slot (so the siblings' load on it is read)."""
        for wid in worker_ids:
            if wid not in self._slots:
                self._slot(wid)

    # ---- the log --------------------------------------------------------------------------------
    def sent(self, worker_id: str, hashes: Sequence[int]) -> None:
        self.table.append(SENT, self.index, msgpack.packb([worker_id, list(hashes)]))

    def pooled(self, hashes: Sequence[int]) -> None:
        """A prompt computed by a pool member: the siblings add it to their view of the KV pool."""
        self.table.append(POOLED, self.index, msgpack.packb(list(hashes)))

    def transferred(self, worker_id: str, tokens: int, seconds: float) -> None:
        self.table.append(TRANSFER, self.index, msgpack.packb([worker_id, tokens, seconds]))

    def added_static(self, url: str, role: str, kv_connector: str | None) -> None:
        self.admin_change(ADD_STATIC, [url, role, kv_connector])

    def drained(self, worker_id: str) -> None:
        self.admin_change(DRAIN, [worker_id])

    def admin_change(self, kind: int, fields: list) -> None:
        """An admin change made here: to the live siblings by the log, to later ones by the admin blob."""
        with self.table.lock:
            raw = self.table.read_blob(self.nprocs)
            state = msgpack.unpackb(raw) if raw else {"static": [], "drained": []}
            state["static" if kind == ADD_STATIC else "drained"].append(fields if kind == ADD_STATIC else fields[0])
            self.table.write_blob(self.nprocs, msgpack.packb(state))
        self.table.append(kind, self.index, msgpack.packb(fields))

    def health_round(self, results: list[list[Any]]) -> None:
        self.table.append(HEALTH, self.index, msgpack.packb(results))

    def catch_up(self) -> None:
        """Apply the siblings' records since the last call (cheap when there are none)."""
        if self._pos == self.table.log_head or self.registry is None:
            return
        self._pos, records, lapped = self.table.read_since(self._pos)
        if lapped:
            self.lapped += 1
            log.warning("router process %d fell behind the shared log: some sibling sends were not replayed",
                        self.index)
        sent: dict[str, list[list[int]]] = {}           # the siblings' sends since the last other record
        for kind, writer, payload in records:
            if writer == self.index:
                continue
            fields = msgpack.unpackb(payload)
            if kind == SENT:
                sent.setdefault(fields[0], []).append(fields[1])
                continue
            self._replay_sent(sent)                       # in log order: an admin or health record may change a worker
            self._apply(kind, fields)
        self._replay_sent(sent)

    def _replay_sent(self, sent: dict[str, list[list[int]]]) -> None:
        """The siblings' sends, one pass per worker (`record_many`): each process replays every sibling's
        send, so at N processes a placement would otherwise pay N - 1 full records."""
        if not sent:
            return
        reg = self.registry
        assert reg is not None
        infos = reg.all_infos()
        for worker_id, prompts in sent.items():
            if worker_id in infos:
                reg.index.approximate.record_many(worker_id, prompts)
        sent.clear()

    def _apply(self, kind: int, fields: Any) -> None:
        reg = self.registry
        assert reg is not None
        if kind == ADD_STATIC:
            reg.add_static(fields[0], fields[1], fields[2], local=False)
        elif kind == DRAIN:
            reg.drain(fields[0], local=False)
        elif kind == HEALTH:
            apply_round(reg, fields)
        elif kind == TRANSFER and fields[0] in reg.all_infos():
            reg.transfer.observe(fields[0], fields[1], fields[2], local=False)
        elif kind == POOLED and reg.pool is not None:
            reg.pool.record(fields)

    # ---- admission and usage --------------------------------------------------------------------
    def admission_changed(self, inflight: int, waiting: int) -> None:
        self.table.set_proc(self.index, ADM_INFLIGHT, inflight)
        self.table.set_proc(self.index, ADM_WAITING, waiting)

    def peer_admission(self) -> tuple[int, int]:
        return (self.table.proc_sum(ADM_INFLIGHT, self.index), self.table.proc_sum(ADM_WAITING, self.index))

    def ready(self) -> None:
        self.table.set_proc(self.index, READY, 1)

    def served(self) -> None:
        self.table.set_proc(self.index, SERVED, self.table.proc(self.index, SERVED) + 1)

    def publish_usage(self, usage: dict[str, Any]) -> None:
        self.table.write_blob(self.index, msgpack.packb(usage))

    def sibling_usage(self) -> list[dict[str, Any]]:
        blobs = (self.table.read_blob(i) for i in range(self.nprocs) if i != self.index)
        return [msgpack.unpackb(b) for b in blobs if b]

    async def run(self, stop: asyncio.Event, usage: Callable[[], dict[str, Any]]) -> None:
        """Follow the log between requests too (an idle process stays current) and publish tenant usage."""
        last = 0.0
        while not stop.is_set():
            self.catch_up()
            if self.registry is not None:
                self.know(self.registry.all_infos())
            if time.monotonic() - last >= USAGE_EVERY_S:
                self.publish_usage(usage())
                last = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), IDLE_TICK_S)


def apply_round(registry: WorkerRegistry, record: list[list]) -> None:
    """Process 0's health round (`health_checker.round_record`), applied as if this process had probed."""
    infos = registry.all_infos()
    for wid, ok, identity, load, blocks in record:
        if wid not in infos:
            continue
        registry.record_check(wid, ok)
        if identity is None:
            registry.identities.pop(wid, None)
        else:
            registry.identities[wid] = identity
        if load is not None:
            registry.loads[wid] = LoadReport.from_dict(load)
        if blocks:
            registry.index.approximate.set_capacity(wid, blocks)
            registry.unsized.discard(wid)


def _pid() -> int:
    return os.getpid()
