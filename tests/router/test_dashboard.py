"""The router's /dashboard: its data (/dashboard/state, admin token only) from a running fleet
(store + real prefill and decode workers + router), the page rendered in headless Chromium showing
those workers, and the pure helpers behind the rates and latencies."""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from PIL import Image

from router.dashboard import History, Sample, quantile, traffic
from tests.e2e.fleet import ADMIN, Fleet, eventually

AUTH = {"Authorization": f"Bearer {ADMIN}"}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--virtual-time-budget=10000"]


# ---- pure helpers ----------------------------------------------------------------------------------

def test_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (math.inf, 40.0)]
    assert quantile(0.25, buckets) == pytest.approx(0.1)             # rank 10: the first bucket's bound
    assert quantile(0.5, buckets) == pytest.approx(0.15)             # rank 20: halfway through (0.1, 0.2]
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * (39.6 - 30) / 10)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.99, [(1.0, 0.0), (math.inf, 5.0)]) == 1.0       # only +Inf: the last finite bound


def hist(values: list[float], bounds=(0.05, 0.1, 0.5, 1.0, math.inf)):
    return tuple((b, float(sum(v <= b for v in values))) for b in bounds), sum(values), float(len(values))


def test_traffic_is_the_difference_between_two_samples():
    old = Sample(100.0, requests=10, errors=1, by_decision={"prefill-decode": 10},
                 histograms={"ttft": hist([0.04] * 10)})
    new = Sample(110.0, requests=30, errors=2, by_decision={"prefill-decode": 25, "decode-only": 5},
                 histograms={"ttft": hist([0.04] * 10 + [0.3] * 20)})
    t = traffic(old, new)
    assert t["request_rate"] == pytest.approx(2.0) and t["error_rate"] == pytest.approx(0.1)
    assert t["decisions"] == pytest.approx({"prefill-decode": 1.5, "decode-only": 0.5})
    ttft = t["latency_ms"]["ttft"]
    assert ttft["count"] == 20 and ttft["mean"] == pytest.approx(300.0)      # only the new requests
    assert 100 < ttft["p50"] <= 500 and 100 < ttft["p99"] <= 500


def test_history_keeps_one_window():
    h = History(window_s=10)
    for t in range(0, 30):
        h.add(Sample(float(t), t, 0, {}, {}))
    assert h.samples[-1].t - h.samples[0].t <= 10 and len(h.series()) == len(h.samples) - 1
    assert all(p["request_rate"] == pytest.approx(1.0) for p in h.series())


# ---- against a running fleet -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet_url(tmp_path_factory, redis_url):
    from engine.checkpoint.create import create_checkpoint
    tmp = tmp_path_factory.mktemp("dashboard")
    model = create_checkpoint("tiny", tmp / "model", seed=0, progress=False)
    with Fleet(tmp, model, redis_url, namespace="dashboard") as fleet:
        workers = [fleet.worker("prefill", "prefill-0"), fleet.worker("decode", "decode-0")]
        router = fleet.router("router")
        for proc in workers:
            fleet.wait(proc)
        fleet.wait(router, "/ready")
        def dashboard_workers() -> int:
            return len(httpx.get(router.url + "/dashboard/state", headers=AUTH, timeout=5).json()["workers"])
        eventually(lambda: dashboard_workers() == 2, 30, "both workers in the dashboard state")
        yield router.url


def chat(url: str, n: int) -> None:
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "tell me " * 40}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    for _ in range(n):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            resp.read()


def test_state_needs_the_admin_token(fleet_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(fleet_url + "/dashboard/state", headers=headers, timeout=5)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_admin_token"
        assert "prefill-0" not in resp.text


def test_page_is_static_and_holds_no_fleet_data(fleet_url):
    resp = httpx.get(fleet_url + "/dashboard", timeout=5)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert "/dashboard/state" in resp.text and "prefill-0" not in resp.text and "<script" in resp.text
    assert "default-src 'self'" in resp.headers["content-security-policy"]
    assert "src=\"http" not in resp.text, "no external assets"


def test_state_shows_the_fleet_and_recent_traffic(fleet_url):
    httpx.get(fleet_url + "/dashboard/state", headers=AUTH, timeout=5)          # a first sample
    chat(fleet_url, 3)

    # the worker publishes KV events on its next heartbeat and the router reads them on its next refresh,
    # up to a second or two after the answer: wait on /admin/workers (each dashboard read is a sample)
    eventually(lambda: {w["worker_id"]: w["cached_blocks"] for w in httpx.get(
        fleet_url + "/admin/workers", headers=AUTH, timeout=5).json()["workers"]}.get("prefill-0", 0) > 0,
        20, "the prefill worker's KV events to reach the router")
    state = httpx.get(fleet_url + "/dashboard/state", headers=AUTH, timeout=5).json()
    workers = {w["worker_id"]: w for w in state["workers"]}
    assert {k: w["role"] for k, w in workers.items()} == {"prefill-0": "prefill", "decode-0": "decode"}
    for w in workers.values():
        assert w["healthy"] is True and w["circuit"] == "closed" and w["draining"] is False
        load = w["load"]
        assert {"running", "waiting", "held", "cache_usage", "age_s"} <= set(load) and 0 <= load["cache_usage"] <= 1
    assert workers["prefill-0"]["cached_blocks"] > 0, "the prefill worker's KV events reached the router"
    assert state["router"] == {**state["router"], "ready": True, "store": "ok", "model": "kimi-k3"}
    traffic_now = state["traffic"]
    assert traffic_now["request_rate"] > 0 and traffic_now["decisions"].get("prefill-decode", 0) > 0
    assert traffic_now["latency_ms"]["ttft"]["count"] == 3 and traffic_now["latency_ms"]["ttft"]["p99"] > 0
    assert state["series"] and state["series"][-1]["request_rate"] > 0


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def browse(url: str, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *mode, url],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)


def rendered(dom: str) -> str:
    """The DOM without the page's own script (whose templates contain the markup it renders)."""
    return re.sub(r"<script>.*?</script>", "", dom, flags=re.DOTALL)


def test_dashboard_renders_the_workers_in_headless_chromium(fleet_url, tmp_path):
    chat(fleet_url, 2)
    proc = browse(f"{fleet_url}/dashboard#token={ADMIN}", tmp_path, "--dump-dom")
    dom = rendered(proc.stdout)
    assert 'data-loaded="true"' in dom, f"the page did not load its state:\n{dom[-2000:]}\n{proc.stderr[-2000:]}"
    for worker in ("prefill-0", "decode-0"):
        assert f'data-worker="{worker}"' in dom
    assert dom.count("badge ok\">healthy</span>") == 2 and "ready</span>" in dom
    assert ADMIN not in dom, "the token is taken out of the page's address"

    shot = tmp_path / "dashboard.png"
    proc = browse(f"{fleet_url}/dashboard#token={ADMIN}", tmp_path, "--window-size=1280,800", f"--screenshot={shot}")
    assert shot.is_file(), proc.stderr[-2000:]
    with Image.open(shot) as img:
        assert img.size == (1280, 800)
        colours = sum(1 for n in img.convert("RGB").quantize(64).histogram() if n)
        assert colours > 8, "a blank screenshot"


def test_dashboard_without_a_token_asks_for_one(fleet_url, tmp_path):
    dom = rendered(browse(f"{fleet_url}/dashboard", tmp_path, "--dump-dom").stdout)
    assert "admin token needed" in dom and 'data-worker="' not in dom


def test_the_last_minute_never_spans_a_gap_between_visits():
    """A page closed for an hour and opened again: the headline is not the hour's average."""
    h = History(window_s=60)
    for t in range(0, 60, 2):                               # a visit: 1 request/s
        h.add(Sample(float(t), float(t), 0, {}, {}))
    h.add(Sample(3600.0, 3600.0 * 0.1, 0, {}, {}))         # an hour later, at 0.1 request/s meanwhile
    assert [s.t for s in h.samples] == [3600.0]            # nothing of the previous visit is left
    h.add(Sample(3602.0, 360.0 + 2 * 1.5, 0, {}, {}))      # now 1.5 requests/s
    assert traffic(h.samples[0], h.samples[-1])["request_rate"] == pytest.approx(1.5)
    for t in range(3604, 3700, 2):
        h.add(Sample(float(t), 363.0 + (t - 3602) * 1.5, 0, {}, {}))
    span = h.samples[-1].t - h.samples[0].t
    assert 60 <= span <= 62 and traffic(h.samples[0], h.samples[-1])["request_rate"] == pytest.approx(1.5)


def test_only_the_fleets_own_failures_count_as_errors():
    from prometheus_client import CollectorRegistry, Counter

    from router.dashboard import sample

    class Metrics:
        requests = Counter("r", "", ["endpoint", "decision", "outcome"], registry=CollectorRegistry())
    for outcome, n in (("ok", 5), ("error", 2), ("client_error", 7), ("cancelled", 3)):
        Metrics.requests.labels(endpoint="chat", decision="d", outcome=outcome).inc(n)
    got = sample(Metrics)
    assert (got.requests, got.errors) == (17, 2)
