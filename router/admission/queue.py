"""The admission queue: when the fleet is saturated, requests wait here, best first, never without end.

Saturated: this replica has `capacity()` requests in flight (each usable decode worker's share:
`--max-inflight-per-worker`). A request that finds no free slot waits in a bounded queue ordered by
(tenant class, request priority, arrival); a slot that frees goes to the head. Each waiter has a
deadline: when it passes, the request leaves with a 503 and `Retry-After` (a full queue answers the
same at once), never a hang. A client that goes away cancels its waiting task, which leaves the queue
at once (its entry is dropped, so it holds no place and no slot).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.admission.limits import Throttled


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int, int]                          # (class, request priority, arrival)
    future: asyncio.Future = field(compare=False)


class AdmissionQueue:
    def __init__(self, capacity: Callable[[], int], max_queued: int, timeout_s: float, metrics=None,
                 siblings: Any = None) -> None:
        """`siblings` (`--workers N`, router/procs/share.py): the other router processes' slots and waiters
        count against the same capacity and bound, so the limits hold for the router as a whole."""
        self.capacity, self.max_queued, self.timeout_s = capacity, max_queued, timeout_s
        self.metrics, self.siblings = metrics, siblings
        self.inflight = 0
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    def _free(self) -> bool:
        return self.inflight + self._peers()[0] < max(1, self.capacity())

    def _peers(self) -> tuple[int, int]:
        return (0, 0) if self.siblings is None else self.siblings.peer_admission()

    async def acquire(self, priority: tuple[int, int], timeout_s: float | None = None) -> float:
        """Take a slot (waiting for one when none is free); returns the seconds waited. Raises `Throttled`
        (503) when the queue is full or the deadline passes; cancelling leaves the queue at once."""
        if self._free() and not self.waiting and not self._peers()[1]:
            self.inflight += 1
            self._gauge()
            return 0.0
        if self.waiting + self._peers()[1] >= self.max_queued:
            self._count("queue_full")
            raise Throttled("The server is at capacity and its queue is full; please retry shortly.",
                            {"retry-after": "1"}, status=503, code="queue_full", type="service_unavailable")
        start, limit = time.monotonic(), timeout_s or self.timeout_s
        waiter = _Waiter((*priority, next(self._seq)), asyncio.get_running_loop().create_future())
        if len(self._heap) > 2 * self.max_queued:    # entries of waiters that left, not yet popped
            self._heap = [w for w in self._heap if not w.future.done()]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, waiter)
        self._gauge()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), limit)
        except TimeoutError:
            if waiter.future.done():                 # granted as the deadline passed
                return time.monotonic() - start
            waiter.future.cancel()
            self._count("queue_timeout")
            raise Throttled(f"The server is at capacity: no slot freed within {limit:g} s in the queue; "
                            "please retry shortly.", {"retry-after": str(max(1, math.ceil(limit / 4)))},
                            status=503, code="queue_timeout", type="service_unavailable") from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()                       # granted as the client left: hand the slot on
            else:
                waiter.future.cancel()
            raise
        finally:
            self._gauge()
        return time.monotonic() - start

    def release(self) -> None:
        """A request that held a slot ended: the head of the queue takes it."""
        self.inflight -= 1
        self.pump()

    def pump(self) -> None:
        """Grant free slots to the best waiters (also called when the fleet grows)."""
        while self._heap and self._free():
            waiter = heapq.heappop(self._heap)
            if waiter.future.done():                 # cancelled or timed out: already gone
                continue
            self.inflight += 1
            waiter.future.set_result(None)
        self._gauge()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.queue_rejections.labels(reason=outcome).inc()

    def _gauge(self) -> None:
        if self.siblings is not None:
            self.siblings.admission_changed(self.inflight, self.waiting)
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            self.metrics.inflight.set(self.inflight)
