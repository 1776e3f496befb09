"""deploy/monitoring: the alert rules and scrape config pass `promtool`, and every metric the Grafana
dashboard and the alert rules name is one the router or the workers export (checked against the real
registries, so a renamed family breaks this test, not a production dashboard). That every query and
alert expression returns data from a live fleet scraped by a real Prometheus is tests/monitoring's job
(opt-in: `-m monitoring`)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # PyYAML, a dev dependency
from prometheus_client import CollectorRegistry

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD, ALERTS, PROMETHEUS = (MONITORING / name for name in ("grafana-dashboard.json", "alerts.yml",
                                                                 "prometheus.yml"))
_METRIC = re.compile(r"(?<![\w:$])((?:vllm:|kimi_pd_)[a-zA-Z0-9_:]+|up)(?=\s*[{\[)])")
_PROMQL_WORDS = {"sum", "rate", "max", "min", "by", "histogram_quantile", "or", "le"}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    """Every sample name the router's and a worker's registries can expose (a DSpark worker's included)."""
    from router.metrics import RouterMetrics
    from worker.metrics import WorkerMetrics
    from worker.spec_metrics import SpecDecodeMetrics
    from worker.vllm_metrics import VllmMetrics
    worker = WorkerMetrics(CollectorRegistry())
    vllm = VllmMetrics(worker.registry, "m", 4096)
    SpecDecodeMetrics(worker.registry, 2, vllm.labels)
    names = set()
    for registry in (worker.registry, RouterMetrics().registry):
        for metric in registry.collect():
            kind = metric.type
            base = metric.name + ("_total" if kind == "counter" else "")
            names.add(base)
            if kind == "histogram":
                names.update(metric.name + s for s in ("_bucket", "_sum", "_count"))
    return names | {"up"}


def test_every_metric_the_dashboard_and_alerts_name_is_exported():
    exported = exported_names()
    named = {m for expr in dashboard_queries() + [r["expr"] for r in alert_rules()] for m in _METRIC.findall(expr)}
    assert named - _PROMQL_WORDS, "the pattern found no metric names"
    assert not named - exported, f"not exported by the router or the workers: {sorted(named - exported)}"
    # the engine panels read vLLM's families, so they show stock vLLM workers too
    assert sum(m.startswith("vllm:") for m in named) >= 15


def test_dashboard_is_grafana_json_with_a_model_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["model_name"]["query"]["query"] == "label_values(vllm:num_requests_running, model_name)"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        vllm_queries = [t["expr"] for t in panel["targets"] if "vllm:" in t["expr"]]
        assert all('model_name=~"$model_name"' in q for q in vllm_queries), panel["title"]


def test_alert_rules_have_severity_summary_and_a_threshold():
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert split_threshold(rule["expr"])[1], rule["alert"]


def split_threshold(expr: str) -> tuple[str, str]:
    """`<query> <op> <number>` -> (query, "<op> <number>"); ("", "") if the expression is not of that form."""
    m = re.fullmatch(r"(.+?)\s*(==|!=|>=|<=|>|<)\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*", expr.strip())
    return (m.group(1), f"{m.group(2)} {m.group(3)}") if m else ("", "")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_rules_and_the_scrape_config():
    for cmd in (["promtool", "check", "rules", str(ALERTS)], ["promtool", "check", "config", str(PROMETHEUS)]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS" in proc.stdout + proc.stderr
