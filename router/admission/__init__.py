"""Admission control (docs/admission.md): which tenant a request belongs to (`tenants`), whether its
limits allow it now (`limits`: shared by every router through the store), and when the fleet has room
for it (`queue`). `Admission` composes them for the request path: `enter` before placement, the
ticket's `leave` when the answer (or stream) ends.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.admission.accounting import Accounting
from router.admission.limits import Grant, RateLimiter, Throttled
from router.admission.queue import AdmissionQueue
from router.admission.tenants import Tenant, Tenants

__all__ = ["Admission", "Ticket", "Throttled", "Tenant", "Tenants"]
log = logging.getLogger(__name__)
DEFAULT_RESERVED_COMPLETION = 256        # tokens reserved when a request sets no max_tokens (settled at the end)


@dataclass
class Ticket:
    """One admitted request: its tenant's grant and (when queued) its slot, released exactly once."""

    admission: Admission
    grant: Grant
    slot: bool
    prompt_tokens: int
    start: float = field(default_factory=time.perf_counter)
    done: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return self.grant.headers or {}

    def leave(self, completion_tokens: int | None, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        self.admission.finish(self, completion_tokens, outcome)


class Admission:
    def __init__(self, tenants: Tenants, limiter: RateLimiter, queue: AdmissionQueue | None,
                 accounting: Accounting, spawn: Callable) -> None:
        self.tenants, self.limiter, self.queue, self.accounting = tenants, limiter, queue, accounting
        self._spawn = spawn                  # runs a coroutine in the background (settling after the answer)

    async def enter(self, tenant: Tenant, request_priority: int, prompt_tokens: int,
                    max_tokens: int | None) -> Ticket:
        """Rate limits first (a throttled tenant never takes a queue place), then a slot in the fleet."""
        label = self.tenants.label(tenant)
        reserve = max_tokens if max_tokens is not None else DEFAULT_RESERVED_COMPLETION
        try:
            grant = await self.limiter.admit(tenant, prompt_tokens, reserve)
        except Throttled:
            self.accounting.rejected(label, "rate_limited")
            raise
        ticket = Ticket(self, grant, False, prompt_tokens)
        if self.queue is not None:
            try:
                waited = await self.queue.acquire((tenant.priority, request_priority), tenant.queue_timeout_s)
            except BaseException as exc:
                self._settle(grant, 0)                              # never served: give the tokens back
                if isinstance(exc, Throttled):
                    self.accounting.rejected(label, exc.code or "queue")
                raise
            ticket.slot = True
            self.accounting.queued(waited)
        return ticket

    def _settle(self, grant: Grant, completion_tokens: int | None) -> None:
        """After the answer, off the request path; only a tokens-per-minute limit has anything to settle."""
        if grant.tenant.tpm is not None:
            self._spawn(self.limiter.settle(grant, completion_tokens))

    def finish(self, ticket: Ticket, completion_tokens: int | None, outcome: str) -> None:
        if ticket.slot and self.queue is not None:
            self.queue.release()
        self._settle(ticket.grant, completion_tokens)
        label = self.tenants.label(ticket.grant.tenant)
        self.accounting.finished(label, ticket.prompt_tokens, completion_tokens or 0, outcome,
                                 time.perf_counter() - ticket.start)
