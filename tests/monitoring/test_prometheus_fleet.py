"""A real Prometheus scrapes a `kimi-pd up` fleet (router, prefill and decode workers) on loopback with
deploy/monitoring/alerts.yml loaded; after some traffic (short prompts placed decode-only, long ones through
prefill and decode, streamed and not) every query of the Grafana dashboard and the query part of every alert
expression returns data with a finite value, and every rule evaluates without error."""
from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from shared.net import free_port
from tests.deploy.test_monitoring import ALERTS, alert_rules, dashboard_queries, split_threshold
from tests.e2e.fleet import kimi_pd_up

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")]
ADMIN = secrets.token_hex(8)


def _worker_targets(url: str) -> list[str]:
    """host:port of every worker the router knows, once a prefill and a decode worker are registered."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).json()
        roles = {w["role"] for w in workers["workers"]}
        if {"prefill", "decode"} <= roles:
            return [urlparse(w["url"]).netloc for w in workers["workers"]]
        time.sleep(0.5)
    raise TimeoutError(f"the router never listed a prefill and a decode worker: {workers}")


def _config(tmp: Path, router: str, workers: list[str]) -> Path:
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(ALERTS)],
              "scrape_configs": [{"job_name": "kimi-pd-router", "static_configs": [{"targets": [router]}]},
                                 {"job_name": "kimi-pd-workers", "static_configs": [{"targets": workers}]}]}
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """(router URL, Prometheus URL) with traffic served and scraped."""
    from engine.checkpoint.create import create_checkpoint
    tmp = tmp_path_factory.mktemp("monitoring")
    model = create_checkpoint("tiny", tmp / "model", seed=0, progress=False)
    env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": ADMIN}
    with kimi_pd_up(["--model", str(model)], tmp / "logs", env=env) as (url, _), \
            open(tmp / "prometheus.log", "w") as log:
        config = _config(tmp, urlparse(url).netloc, _worker_targets(url))
        port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=log)
        prom_url = f"http://127.0.0.1:{port}"
        try:
            _wait(lambda: httpx.get(prom_url + "/-/ready", timeout=2).status_code == 200, "prometheus ready")
            targets = 1 + len(_worker_targets(url))          # every target scraped before the traffic: rates
            _wait(lambda: _value(prom_url, "count(up == 1)") == targets, "every target scraped")  # need a before
            served = _traffic(url)
            _wait(lambda: _value(prom_url, "sum(vllm:request_success_total)") >= served, "the traffic scraped")
            time.sleep(3)                       # a few more scrapes and rule evaluations after the last request
            yield url, prom_url
        finally:
            prom.terminate()
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait(10)


def _wait(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(what)


def _traffic(url: str) -> int:
    """Requests of every kind the panels show; how many engine requests they made (P/D counts twice)."""
    short, long = "What is 2 + 3?", " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    engine_requests = 0
    for prompt, pd in ((short, False), (long, True), (short, False), (long + " again", True)):
        for stream in (False, True):
            body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": 8, "stream": stream, "ignore_eos": True}
            resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            engine_requests += 2 if pd else 1
    chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": long}], "max_tokens": 8, "stream": True}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    return engine_requests + 2


def _query(prom_url: str, expr: str) -> list[dict]:
    resp = httpx.get(prom_url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert resp["status"] == "success", (expr, resp)
    return resp["data"]["result"]


def _value(prom_url: str, expr: str) -> float:
    result = _query(prom_url, expr)
    return float(result[0]["value"][1]) if result else -1.0


def _grafana(expr: str) -> str:
    """The dashboard's Grafana variables as Grafana fills them for "All"; 1m, its rate window for a 15 s scrape"""
    return expr.replace("$model_name", ".*").replace("$__rate_interval", "1m")


def test_every_dashboard_query_returns_data(prometheus):
    _, prom_url = prometheus
    empty, not_finite = [], []
    for expr in dashboard_queries():
        result = _query(prom_url, _grafana(expr))
        if not result:
            empty.append(expr)
        elif not any(math.isfinite(float(r["value"][1])) for r in result):
            not_finite.append(expr)
    assert not empty, f"no data: {empty}"
    assert not not_finite, f"only NaN/Inf: {not_finite}"


def test_every_alert_expression_returns_data_and_every_rule_evaluates(prometheus):
    _, prom_url = prometheus
    rules = alert_rules()
    for rule in rules:
        query, _ = split_threshold(rule["expr"])
        result = _query(prom_url, query)
        for _ in range(15):             # a rate() over the newest scrapes may need one more sample
            if result:
                break
            time.sleep(1)
            result = _query(prom_url, query)
        assert result, f"{rule['alert']}: {query} returned nothing"
        assert any(math.isfinite(float(r["value"][1])) for r in result), rule["alert"]
    # rules are evaluated every second: one that has not run yet reads "unknown", and one that saw the fleet
    # still starting may be pending for an evaluation or two; the settled state is what must be clean
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(prom_url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        bad = {name: r.get("lastError") for name, r in loaded.items() if r["health"] != "ok"}
        firing = [name for name, r in loaded.items() if r["state"] != "inactive"]
        if (not bad and not firing) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(loaded) == {r["alert"] for r in rules}
    assert not bad, bad
    assert not firing, f"a healthy fleet fires {firing}"
