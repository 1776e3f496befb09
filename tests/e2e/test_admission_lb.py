"""Two routers behind the repo's haproxy.cfg share one tenant limit through the store; with the store
gone each keeps serving with half of it, and says so in its metrics."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from shared.net import free_port
from shared.store.embedded import EmbeddedValkey
from tests.deploy.test_multinode_rehearsal import Procs, start_lb
from tests.e2e.fleet import eventually, metric

pytestmark = pytest.mark.timeout(120)
TENANTS = '[tenants.acme]\nkeys = ["sk-acme-lb-0001"]\nrpm = 10\n'
BODY = {"model": "kimi-k3", "prompt": "hello", "max_tokens": 2}
AUTH = {"authorization": "Bearer sk-acme-lb-0001"}


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def burst(url: str, n: int) -> list[int]:
    codes = []
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            resp = client.post(url + "/v1/completions", json=BODY, headers=AUTH)
            codes.append(resp.status_code)
            if resp.status_code == 429:          # through the LB: OpenAI's body and the headers clients read
                assert resp.json()["error"]["code"] == "rate_limit_exceeded"
                assert int(resp.headers["retry-after"]) >= 1 and resp.headers["x-ratelimit-limit-requests"] == "10"
    return codes


def test_two_routers_behind_the_lb_share_one_limit_then_split_it_without_the_store(tmp_path):
    (tmp_path / "tenants.toml").write_text(TENANTS)
    procs, store = Procs(tmp_path), EmbeddedValkey()
    store.start()
    try:
        repo = str(Path(__file__).resolve().parents[2])    # the children run in tmp_path: `tests` from this tree
        env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": "lb-admin-token", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        stub_port = free_port()
        procs.spawn("stub", [sys.executable, "-m", "tests.stub_worker", "--port", str(stub_port)], env)
        ports = {n: free_port() for n in "ab"}
        for n, port in ports.items():
            procs.spawn(f"router-{n}", [sys.executable, "-m", "kimi_pd", "router", "--no-tokenizer",
                                        "--port", str(port), "--worker", f"http://127.0.0.1:{stub_port}",
                                        "--redis-url", store.url, "--namespace", "lb-limit",
                                        "--tenants", str(tmp_path / "tenants.toml")], env)
        routers = [f"http://127.0.0.1:{p}" for p in ports.values()]
        for r in routers:
            eventually(lambda r=r: _up(r), 60, f"router {r}")
        _, lb = start_lb({"tmp": tmp_path, "procs": procs, "ports": {n: {"KIMI_PD_ROUTER_PORT": p}
                                                                        for n, p in ports.items()}}, "haproxy")
        codes = burst(lb, 16)
        # one limit of 10 a minute for both (a token refills every 6 s: at most one more in the run)
        assert codes.count(200) in (10, 11) and set(codes) == {200, 429}, codes
        assert all(metric(r, "kimi_pd_router_tenant_requests_total", tenant="acme") >= 3 for r in routers)
        admin = {"authorization": "Bearer lb-admin-token"}
        # each router has counted both in the store (a heartbeat every 2 s): the split it falls back to
        eventually(lambda: all(httpx.get(r + "/admin/tenants", headers=admin).json()["router_replicas"] == 2
                               for r in routers), 20, "both routers counted")
        store.stop()
        eventually(lambda: all(metric(r, "kimi_pd_router_ratelimit_local") == 1 for r in routers), 20,
                   "both routers on local limits")
        codes = burst(lb, 16)
        assert codes.count(200) in (10, 11, 12), codes          # 5 each (1/2 of the limit), refills aside
    finally:
        procs.close()
        store.stop()
