"""The sender's lease table: which published states are held, until when, and who is reading them.

Life of a lease:

    add ──> HELD ──(release | abort | expiry | close)──> ENDED ──(last reader gone)──> FREED
             │  acquire/unacquire count readers            │ no new readers; readers
             │                                             │ still in flight fail `check`
             └──────────── no readers: ENDED and FREED at once ─────────────────────────┘

Invariants:
- `on_free(request_id, reason)` runs exactly once per added lease, with the reason of the first
  end, and only once no reader holds the lease (so freed memory is never read).
- An expired lease is never readable: `acquire` and `check` test the clock themselves, so they do
  not depend on `sweep` having run.
- `held_count()` counts leases whose `on_free` has not run.
Pure: no I/O, no event loop; the clock is injectable. Thread-safe; `on_free` runs outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_transfer.errors import (
    DuplicateRequest,
    LeaseExpired,
    RequestAborted,
    SenderShutdown,
    TransferError,
    UnknownRequest,
)

logger = logging.getLogger(__name__)

OnFree = Callable[[str, str], None]
_ENDED_ERRORS: dict[str, type[TransferError]] = {
    "expired": LeaseExpired, "aborted": RequestAborted, "shutdown": SenderShutdown,
    "released": UnknownRequest,
}


@dataclass
class Lease:
    """One held state. `ended` is the reason of the first end; `readers` counts active pulls."""

    request_id: str
    payload: Any
    expires_at: float
    on_free: OnFree
    readers: int = 0
    ended: str | None = None
    added_at: float = 0.0


class LeaseTable:
    """Held leases by request id, plus a bounded memory of how recent ones ended."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[str], None] | None = None,
        remembered: int = 4096,
    ) -> None:
        self._clock = clock
        self._on_end = on_end
        self._remembered = remembered
        self._live: dict[str, Lease] = {}
        self._unfreed: dict[str, Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, payload: Any, lease_s: float, on_free: OnFree) -> Lease:
        """Hold `payload` until `now + lease_s`. Raises `DuplicateRequest` if still unfreed."""
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        with self._lock:
            if request_id in self._unfreed:
                raise DuplicateRequest(f"request {request_id!r} is already held")
            now = self._clock()
            lease = Lease(request_id, payload, now + lease_s, on_free, added_at=now)
            self._live[request_id] = self._unfreed[request_id] = lease
            self._ended.pop(request_id, None)
            return lease

    def acquire(self, request_id: str) -> Lease:
        """Register a reader. Raises `LeaseExpired`, `RequestAborted`, ... or `UnknownRequest`."""
        freed: list[Lease] = []
        try:
            with self._lock:
                lease = self._live.get(request_id)
                if lease is not None and self._clock() >= lease.expires_at:
                    self._end_locked(lease, "expired", freed)
                    lease = None
                if lease is None:
                    raise self._gone_error(request_id)
                lease.readers += 1
                return lease
        finally:
            self._run_frees(freed)

    def check(self, lease: Lease) -> None:
        """Raise the typed error if `lease` stopped being readable (ended, or past its expiry)."""
        freed: list[Lease] = []
        with self._lock:
            if lease.ended is None and self._clock() >= lease.expires_at:
                self._end_locked(lease, "expired", freed)
            ended = lease.ended
        self._run_frees(freed)
        if ended is not None:
            raise _ENDED_ERRORS[ended](f"request {lease.request_id!r} {ended} during the transfer")

    def unacquire(self, lease: Lease) -> None:
        """Drop a reader; frees the lease if it ended and this was its last reader."""
        freed: list[Lease] = []
        with self._lock:
            lease.readers -= 1
            if lease.ended is not None and lease.readers == 0:
                self._free_locked(lease, freed)
        self._run_frees(freed)

    def end(self, request_id: str, reason: str) -> bool:
        """End a held lease (`released`, `aborted`); False if it was not held (or already ended)."""
        freed: list[Lease] = []
        with self._lock:
            lease = self._live.get(request_id)
            if lease is not None:
                self._end_locked(lease, reason, freed)
        self._run_frees(freed)
        return lease is not None

    def renew(self, request_id: str, lease_s: float, max_total_s: float) -> bool:
        """Hold a live lease until `now + lease_s`, never past `max_total_s` from when it was added (and
        never shorter than it already was); False if it is not held or already expired."""
        with self._lock:
            lease = self._live.get(request_id)
            now = self._clock()
            if lease is None or now >= lease.expires_at:
                return False
            lease.expires_at = max(lease.expires_at, min(now + lease_s, lease.added_at + max_total_s))
            return True

    def sweep(self) -> int:
        """End every lease past its expiry; returns how many."""
        freed: list[Lease] = []
        with self._lock:
            now = self._clock()
            due = [lease for lease in self._live.values() if now >= lease.expires_at]
            for lease in due:
                self._end_locked(lease, "expired", freed)
        self._run_frees(freed)
        return len(due)

    def close(self) -> None:
        """End every lease with reason `shutdown` (frees those without readers now)."""
        freed: list[Lease] = []
        with self._lock:
            for lease in list(self._live.values()):
                self._end_locked(lease, "shutdown", freed)
        self._run_frees(freed)

    def held_count(self) -> int:
        with self._lock:
            return len(self._unfreed)

    def _gone_error(self, request_id: str) -> TransferError:
        reason = self._ended.get(request_id)
        if reason is None:
            return UnknownRequest(f"no lease for request {request_id!r}")
        if reason == "released":
            return UnknownRequest(f"request {request_id!r} was already released")
        return _ENDED_ERRORS[reason](f"request {request_id!r} {reason}")

    def _end_locked(self, lease: Lease, reason: str, freed: list[Lease]) -> None:
        lease.ended = reason
        del self._live[lease.request_id]
        self._ended[lease.request_id] = reason
        while len(self._ended) > self._remembered:
            self._ended.popitem(last=False)
        if self._on_end is not None:
            self._on_end(reason)
        if lease.readers == 0:
            self._free_locked(lease, freed)

    def _free_locked(self, lease: Lease, freed: list[Lease]) -> None:
        if self._unfreed.pop(lease.request_id, None) is lease:
            freed.append(lease)

    @staticmethod
    def _run_frees(freed: list[Lease]) -> None:
        for lease in freed:
            lease.payload = None
            try:
                lease.on_free(lease.request_id, lease.ended or "released")
            except Exception:  # noqa: BLE001 - a caller's callback must not break the table
                logger.exception("on_free callback failed for request %s", lease.request_id)
