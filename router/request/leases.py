"""Renewing the prefill states this router's requests wait for, so a router's death frees them in seconds.

A prefill leg sent with `x-kimi-pd-lease-renew: 1` publishes its state under a short lease (the worker's
`--kv-renewed-lease-s`, 5 s) instead of the full one (`--kv-lease-s`, 30 s). From the prefill answer until
the decode worker has answered (it has pulled the state by then), the router renews that lease every
`RENEW_EVERY_S`, one batched `/internal/kv/renew` per prefill worker. A router that is killed stops
renewing, so what it left held is freed a few seconds later; the full lease still bounds every state.
Only our own prefill workers take part, and only when the router has the admin token the route needs.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from router.request.fleet import Fleet
from router.request.trace import Trace
from shared.openai.ids import LEASE_RENEW_HEADER

log = logging.getLogger(__name__)
RENEW_EVERY_S = 1.0


def renews(fleet: Fleet, worker_id: str) -> bool:
    """Whether this router renews the leases of prefill states on this worker (proven ours, admin token known)."""
    return bool(fleet.admin_token) and fleet.registry.is_proven(worker_id)


def renew_headers(fleet: Fleet, worker_id: str) -> dict[str, str]:
    """The prefill leg's header asking for the short, renewed lease."""
    return {LEASE_RENEW_HEADER: "1"} if renews(fleet, worker_id) else {}


class LeaseKeeper:
    def __init__(self, fleet: Fleet, every_s: float = RENEW_EVERY_S) -> None:
        self.fleet, self.every_s = fleet, every_s
        self._held: dict[str, dict[str, None]] = {}        # prefill worker URL -> remote request ids (ordered)
        self._task: asyncio.Task | None = None
        self._unsupported: set[str] = set()                # workers without the route (older or stubs): full lease

    @asynccontextmanager
    async def kept(self, trace: Trace) -> AsyncIterator[None]:
        """Renew the lease of `trace`'s prefill state (if it has one of ours) while the block runs."""
        key = self._add(trace)
        try:
            yield
        finally:
            if key is not None:
                ids = self._held.get(key[0], {})
                ids.pop(key[1], None)
                if not ids:
                    self._held.pop(key[0], None)

    def held(self) -> int:
        return sum(len(ids) for ids in self._held.values())

    def _add(self, trace: Trace) -> tuple[str, str] | None:
        ktp, worker_id = trace.kv_transfer_params, trace.prefill_worker
        if ktp is None or not ktp.remote_request_id or worker_id is None or not renews(self.fleet, worker_id):
            return None
        info = self.fleet.registry.all_infos().get(worker_id)
        if info is None or info.url in self._unsupported:
            return None
        self._held.setdefault(info.url, {})[ktp.remote_request_id] = None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return info.url, ktp.remote_request_id

    async def _loop(self) -> None:
        """Runs while anything is held; ends by itself when nothing is (started again by the next hold)."""
        while self._held:
            await asyncio.sleep(self.every_s)
            await asyncio.gather(*(self._renew(url, list(ids)) for url, ids in list(self._held.items()) if ids))

    async def _renew(self, url: str, ids: list[str]) -> None:
        fleet = self.fleet
        try:
            resp = await fleet.client.post(f"{url}/internal/kv/renew", json={"request_ids": ids},
                                           headers={"authorization": f"Bearer {fleet.admin_token}"},
                                           timeout=fleet.s.connect_timeout_s)
            if resp.status_code == 404:             # a worker that does not renew gave these the full lease
                self._unsupported.add(url)
                self._held.pop(url, None)
                log.info("a prefill worker does not serve lease renewals; its states keep the full lease")
            elif resp.status_code != 200:
                log.warning("prefill worker refused a lease renewal: %s", resp.status_code)
        except httpx.HTTPError as exc:
            log.warning("could not renew %d prefill leases: %s", len(ids), type(exc).__name__)
