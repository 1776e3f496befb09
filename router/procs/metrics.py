"""`/metrics` and the dashboard under `--workers N`: every process's metrics added up.

prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the parent before the children
start): each process writes its samples to mmap'd files of its own, and whichever process answers a
scrape reads them all (`MultiProcessCollector`: counters and histograms summed, gauges by their mode in
router/metrics.py). The parent marks a dead child's files, so a restart drops its live gauges but keeps
its counts. Plus what only the table knows: processes, restarts, requests each process served.
"""
from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from router.procs.share import SERVED, ProcessShare


class TableCollector:
    """kimi_pd_router_processes, _process_restarts_total and _process_requests_total{process}."""

    def __init__(self, share: ProcessShare) -> None:
        self.share = share

    def collect(self):
        table = self.share.table
        yield GaugeMetricFamily("kimi_pd_router_processes", "Router processes serving the port", table.nprocs)
        yield CounterMetricFamily("kimi_pd_router_process_restarts", "Router processes restarted after dying",
                                  table.restarts)
        served = CounterMetricFamily("kimi_pd_router_process_requests",
                                     "Requests each router process took (the kernel's spread of connections)",
                                     labels=["process"])
        for i in range(table.nprocs):
            served.add_metric([str(i)], table.proc(i, SERVED))
        yield served


def scrape_registry(share: ProcessShare) -> CollectorRegistry:
    """A registry for one scrape: every process's files, and the table's figures."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    registry.register(TableCollector(share))
    return registry


class _Merged:
    def __init__(self, name: str) -> None:
        self.name = name

    def collect(self) -> list:
        collector = MultiProcessCollector(None, os.environ["PROMETHEUS_MULTIPROC_DIR"])
        return [family for family in collector.collect() if family.name == self.name]


class MergedMetrics:
    """`RouterMetrics` as the dashboard samples it (`metric.collect()`), summed over every process."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def __getattr__(self, name: str) -> _Merged:
        return _Merged(getattr(self.metrics, name).describe()[0].name)
