"""Prometheus metrics of kv_transfer.

Names (labels in brackets; `direction` is `send` or `recv`, `transport` the registry name):

- `kimi_pd_kv_transfer_bytes_total[direction, transport]`: state bytes moved by successful transfers.
- `kimi_pd_kv_transfers_total[direction, transport]`: successful transfers (whole states).
- `kimi_pd_kv_transfer_failures_total[direction, transport, reason]`: failed transfers; `reason` is
  the `TransferError.code` (`lease_expired`, `timeout`, `peer_closed`, `corrupt_frame`, ...).
- `kimi_pd_kv_expired_leases_total[transport]`: leases freed because they expired unreleased.
- `kimi_pd_kv_held_leases[transport]`: leases currently held by senders (gauge).
- `kimi_pd_kv_transfer_seconds[direction, transport]`: wall time of successful transfers (histogram).

The receiver counts a pull once; the sender counts bytes per stream and a transfer when a pull's
first stream completes. One `TransferMetrics` exists per registry (`get_metrics`), so several
senders and receivers in a process share it; tests pass their own `CollectorRegistry` so they
never collide.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class TransferMetrics:
    """The metric families, registered once in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.bytes = Counter(
            "kimi_pd_kv_transfer_bytes", "State bytes moved", ["direction", "transport"], registry=registry
        )
        self.transfers = Counter(
            "kimi_pd_kv_transfers", "Successful transfers", ["direction", "transport"], registry=registry
        )
        self.failures = Counter(
            "kimi_pd_kv_transfer_failures", "Failed transfers",
            ["direction", "transport", "reason"], registry=registry,
        )
        self.expired = Counter(
            "kimi_pd_kv_expired_leases", "Leases freed by expiry", ["transport"], registry=registry
        )
        self.held = Gauge("kimi_pd_kv_held_leases", "Leases held now", ["transport"], registry=registry)
        self.seconds = Histogram(
            "kimi_pd_kv_transfer_seconds", "Transfer wall time", ["direction", "transport"],
            buckets=_BUCKETS, registry=registry,
        )

    def succeeded(self, direction: str, transport: str, nbytes: int, seconds: float) -> None:
        self.bytes.labels(direction, transport).inc(nbytes)
        self.transfers.labels(direction, transport).inc()
        self.seconds.labels(direction, transport).observe(seconds)

    def failed(self, direction: str, transport: str, reason: str) -> None:
        self.failures.labels(direction, transport, reason).inc()


_LOCK = threading.Lock()
_BY_REGISTRY: dict[int, tuple[CollectorRegistry, TransferMetrics]] = {}


def get_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The shared `TransferMetrics` of `registry` (the global default registry when None)."""
    registry = REGISTRY if registry is None else registry
    with _LOCK:
        entry = _BY_REGISTRY.get(id(registry))
        if entry is None or entry[0] is not registry:
            entry = (registry, TransferMetrics(registry))
            _BY_REGISTRY[id(registry)] = entry
        return entry[1]
