"""`GET /dashboard`: a self-refreshing status page for operators; `GET /dashboard/state`: its data.

The page is static HTML with inline JS and CSS (no build step, no external assets) and holds no
data; it polls `/dashboard/state` every 2 s. That JSON shows fleet internals (worker ids and URLs,
circuit states, load, cache usage, held leases), so it is protected like the admin endpoints: it
needs the admin token as a bearer header. The page takes the token from the URL fragment
(`/dashboard#token=...`, which browsers never send to the server, so it appears in no access log)
or from a form, keeps it in sessionStorage and strips it from the address bar. Behind the
deploy/ load balancers `/dashboard` is not routed (like /admin): open it on a router directly.

Recent rates and latencies come from the router's own Prometheus metrics, sampled when the state
is read (a ring of snapshots, oldest dropped after `WINDOW_S`): nothing is added to the request
path, and an unwatched router does no dashboard work.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

if TYPE_CHECKING:  # only for annotations: the registry module is the app's, not the dashboard's
    from router.registry import WorkerRegistry

WINDOW_S = 60.0
# a sample at most this much older than the window still opens it (the page polls every 2 s); an older one
# is from a previous visit, and a rate over the time since then is not "the last minute"
STALE_MARGIN_S = 10.0
MAX_SAMPLES = 600
HTML_FILE = Path(__file__).with_name("dashboard.html")


@dataclass(frozen=True)
class Sample:
    """Cumulative router counters at one moment."""

    t: float
    requests: float
    errors: float
    by_decision: dict[str, float]
    histograms: dict[str, tuple[tuple[tuple[float, float], ...], float, float]]   # name -> (buckets, sum, count)


def _samples(metric) -> list:
    return [s for family in metric.collect() for s in family.samples]


def sample(metrics, clock: Callable[[], float] = time.time) -> Sample:
    requests = errors = 0.0
    by_decision: dict[str, float] = {}
    for s in _samples(metrics.requests):
        if not s.name.endswith("_total"):
            continue
        requests += s.value
        errors += s.value if s.labels.get("outcome") == "error" else 0.0   # not the clients' 4xx or hang-ups
        key = s.labels.get("decision", "none")
        by_decision[key] = by_decision.get(key, 0.0) + s.value
    hists = {}
    for name in ("ttft", "tpot", "e2e", "prefill_seconds", "transfer_seconds"):
        metric = getattr(metrics, name, None)
        if metric is None:
            continue
        buckets, total, count = [], 0.0, 0.0
        for s in _samples(metric):
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
        hists[name.removesuffix("_seconds")] = (tuple(sorted(buckets)), total, count)
    return Sample(clock(), requests, errors, by_decision, hists)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            width = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / width if width else 0.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def traffic(old: Sample, new: Sample) -> dict:
    """Rates and latencies between two samples (ms for latencies)."""
    dt = max(new.t - old.t, 1e-9)
    latency: dict[str, dict[str, float | None]] = {}
    out = {"window_s": round(new.t - old.t, 1),
           "request_rate": (new.requests - old.requests) / dt,
           "error_rate": (new.errors - old.errors) / dt,
           "decisions": {k: (v - old.by_decision.get(k, 0.0)) / dt for k, v in new.by_decision.items()},
           "latency_ms": latency}
    for name, (buckets, total, count) in new.histograms.items():
        old_buckets, old_total, old_count = old.histograms.get(name, ((), 0.0, 0.0))
        before = dict(old_buckets)
        delta = [(b, c - before.get(b, 0.0)) for b, c in buckets]
        n = count - old_count
        p50, p99 = quantile(0.5, delta), quantile(0.99, delta)
        latency[name] = {"count": n, "mean": (total - old_total) / n * 1e3 if n else None,
                                   "p50": None if p50 is None else p50 * 1e3,
                                   "p99": None if p99 is None else p99 * 1e3}
    return out


@dataclass
class History:
    """Samples of the last WINDOW_S seconds, taken when the dashboard reads the state."""

    window_s: float = WINDOW_S
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, s: Sample) -> None:
        self.samples.append(s)
        while len(self.samples) > 2 and s.t - self.samples[1].t >= self.window_s:
            self.samples.popleft()
        if len(self.samples) > 1 and s.t - self.samples[0].t > self.window_s + STALE_MARGIN_S:
            self.samples.popleft()          # the page was closed: measure from now on, not across the gap

    def series(self) -> list[dict]:
        """Per-interval request rate and TTFT p99, oldest first (the page's sparklines)."""
        pts = list(self.samples)
        out = []
        for a, b in zip(pts, pts[1:], strict=False):
            t = traffic(a, b)
            out.append({"t": b.t, "request_rate": t["request_rate"],
                        "ttft_p99_ms": t["latency_ms"].get("ttft", {}).get("p99")})
        return out


def fleet_state(app_state, history: History, ready_state: Callable[[WorkerRegistry], dict],
                clock: Callable[[], float] = time.time) -> dict:
    registry = app_state.registry
    now = clock()
    history.add(sample(getattr(app_state, "merged_metrics", None) or app_state.metrics, clock))   # all processes
    workers = []
    for w in registry.snapshot():
        load = w.get("load")
        if load:
            load = {**load, "age_s": round(now - load["ts"], 1) if load.get("ts") else None}
            load.pop("extra", None)
        workers.append({**w, "load": load})
    oldest, newest = history.samples[0], history.samples[-1]
    return {"router": {"model": app_state.settings.served_model_name, "store": "none" if registry.store is None else
                       ("ok" if registry.store_ok else "unavailable"),
                       "ready": bool(ready_state(registry)["ready"]), "time": now},
            "workers": workers,
            "tenants": app_state.admission.accounting.snapshot() if hasattr(app_state, "admission") else {},
            "traffic": traffic(oldest, newest) if len(history.samples) > 1 else None,
            "series": history.series()}


def install(app: FastAPI, check_admin: Callable[[Request], None],
            ready_state: Callable[[WorkerRegistry], dict]) -> None:
    """Add /dashboard and /dashboard/state to the router app (`check_admin` raises for a bad token;
    `ready_state(registry)` is the router's own /ready verdict)."""
    history = History()
    html = HTML_FILE.read_text()

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                                           "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; img-src 'self' data:"})

    async def state(request: Request) -> JSONResponse:
        check_admin(request)
        return JSONResponse(fleet_state(request.app.state, history, ready_state), headers={"Cache-Control": "no-store"})

    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/state", state, methods=["GET"], include_in_schema=False)
