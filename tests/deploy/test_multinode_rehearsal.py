"""The multi-node wiring of deploy/compose/roles/, rehearsed on loopback with the commands the
containers would run: the store's entrypoint script, each role's kimi-pd command line (only the
/models/model mount mapped to a local directory) with the environment its compose file gives it,
and the repo's nginx.conf / haproxy.cfg in front of two routers ("node A": prefill + router,
"node B": decode + router). Each node advertises its address (127.0.0.1 here) and its own ports."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared.net import free_port
from shared.store.embedded import find_server_binary
from tests.deploy.helpers import HAPROXY_CFG, NGINX_CONF, as_argv, environment_of, nginx_with_routers, tool
from tests.deploy.roles import NODE_ENV_EXAMPLE, read_env_file, role_service
from tests.deploy.test_deploy_configs import service_argv
from tests.e2e.fleet import eventually, metric

pytestmark = pytest.mark.timeout(300)
PASSWORD = "rehearsal-store-password"
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)     # > --disagg-threshold tokens


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "ab") as log:          # the child keeps its own copy of the fd
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                                start_new_session=True)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def node_env(model: Path, redis_url: str, **values: int | str) -> dict[str, str]:
    env = read_env_file(NODE_ENV_EXAMPLE)
    env.update(KIMI_PD_HOST_ADDR="127.0.0.1", KIMI_PD_BIND="127.0.0.1", KIMI_PD_MODEL_DIR=str(model),
               KIMI_PD_REDIS_URL=redis_url, KIMI_PD_STORE_PASSWORD=PASSWORD, KIMI_PD_STORE_BIND="127.0.0.1",
               KIMI_PD_TRANSFER_SECRET="rehearsal-transfer-secret-0123456789", KIMI_PD_ADMIN_TOKEN="rehearsal-admin")
    env.update({k: str(v) for k, v in values.items()})
    return env


def container(role: str, env: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(argv, environment, health probe) of the role's container, the mount mapped to the local model."""
    service = role_service(role, env)
    argv = [env["KIMI_PD_MODEL_DIR"] if a == "/models/model" else a for a in service_argv(service)]
    assert argv[0] == "kimi-pd"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_PD_")}
    proc_env = {**clean, **{k: v for k, v in environment_of(service).items() if v is not None}}
    probe = as_argv(service["healthcheck"]["test"])
    assert probe[:2] == ["CMD", "python"]
    return [sys.executable, "-m", "kimi_pd", *argv[1:]], proc_env, [sys.executable, *probe[2:]]


def wait_probe(procs: Procs, name: str, probe: list[str], env: dict[str, str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if procs.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited:\n{procs.log(name)}")
        if subprocess.run(probe, env=env, capture_output=True, timeout=10).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name}: its health probe did not pass in {timeout_s} s:\n{procs.log(name)}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from engine.checkpoint.create import create_checkpoint
    tmp = tmp_path_factory.mktemp("rehearsal")
    tmp.chmod(0o755)                     # nginx workers (nobody, when run as root) read their paths here
    model = create_checkpoint("tiny", tmp / "model", seed=0, progress=False)
    procs = Procs(tmp)
    try:
        store_port = free_port()
        redis_url = f"redis://:{PASSWORD}@127.0.0.1:{store_port}/0"
        ports = {"a": dict(KIMI_PD_PREFILL_PORT=free_port(), KIMI_PD_KV_PORT=free_port(),
                           KIMI_PD_ROUTER_PORT=free_port()),
                 "b": dict(KIMI_PD_DECODE_PORT=free_port(), KIMI_PD_ROUTER_PORT=free_port())}
        # the store node: the store service's own entrypoint script, with valkey-server on PATH
        env = node_env(model, redis_url, KIMI_PD_STORE_PORT=store_port)
        store = role_service("store", env)
        path = f"{find_server_binary().parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        procs.spawn("store", [*as_argv(store["entrypoint"]), *as_argv(store["command"])],
                    {"PATH": path, **environment_of(store)})
        eventually(lambda: _ping(redis_url), 20, "the store")
        nodes = {}
        for node, roles in (("a", ("prefill", "router")), ("b", ("decode", "router"))):
            env = node_env(model, redis_url, **ports[node])
            for role in roles:
                argv, proc_env, probe = container(role, env)
                name = f"{role}-{node}"
                procs.spawn(name, argv, proc_env)
                nodes[name] = (probe, proc_env)
        for name, (probe, proc_env) in nodes.items():
            wait_probe(procs, name, probe, proc_env)
        yield {"procs": procs, "tmp": tmp, "redis_url": redis_url, "ports": ports,
               "routers": [f"http://127.0.0.1:{ports[n]['KIMI_PD_ROUTER_PORT']}" for n in "ab"]}
    finally:
        procs.close()


def _ping(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_timeout=1).ping()
    except redis.RedisError:
        return False


def test_store_requires_its_password(fleet):
    no_password = re.sub(r"//:[^@]*@", "//", fleet["redis_url"])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(no_password, socket_timeout=2).set("k", "v")
    assert _ping(fleet["redis_url"])


def test_both_routers_see_both_nodes_workers(fleet):
    a, b = fleet["ports"]["a"], fleet["ports"]["b"]
    expected = {f"prefill-127.0.0.1:{a['KIMI_PD_PREFILL_PORT']}": f"http://127.0.0.1:{a['KIMI_PD_PREFILL_PORT']}",
                f"decode-127.0.0.1:{b['KIMI_PD_DECODE_PORT']}": f"http://127.0.0.1:{b['KIMI_PD_DECODE_PORT']}"}
    for router in fleet["routers"]:
        # a router learns the fleet from the store on its refresh tick, after its own health probe passes
        seen: dict[str, str] = {}

        def sees_both(router: str = router, seen: dict[str, str] = seen) -> bool:
            workers = httpx.get(router + "/admin/workers", timeout=5,
                                headers={"Authorization": "Bearer rehearsal-admin"}).json()["workers"]
            seen.clear()
            seen.update({w["worker_id"]: w["url"] for w in workers})
            return seen == expected
        try:
            eventually(sees_both, 30, f"{router} to list both nodes' workers")
        except AssertionError as exc:
            procs = fleet["procs"]
            router_log = procs.log("router-a" if router == fleet["routers"][0] else "router-b")
            raise AssertionError(f"{router} lists {seen}, expected {expected}\n"
                                 f"prefill-a log:\n{procs.log('prefill-a')}\nrouter log:\n{router_log}") from exc


def start_lb(fleet, kind: str) -> tuple[str, str]:
    tmp, procs = fleet["tmp"], fleet["procs"]
    port = free_port()
    router_ports = [fleet["ports"][n]["KIMI_PD_ROUTER_PORT"] for n in "ab"]
    if kind == "nginx":
        routers = tmp / "routers.conf"
        routers.write_text("".join(f"server 127.0.0.1:{p} max_fails=3 fail_timeout=10s;\n" for p in router_ports))
        conf = nginx_with_routers(NGINX_CONF.read_text(), routers).replace("listen 8000;", f"listen 127.0.0.1:{port};")
        (tmp / "nginx.conf").write_text(conf)
        user = "user root;" if os.geteuid() == 0 else ""
        argv = [tool("nginx"), "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", "stderr",
                "-g", f"daemon off; pid {tmp / 'nginx.pid'}; {user}"]
    else:
        text = HAPROXY_CFG.read_text().replace("bind :8000", f"bind 127.0.0.1:{port}")
        for i, p in enumerate(router_ports, 1):
            text = text.replace(f"server router-{i} router-{i}:8000", f"server router-{i} 127.0.0.1:{p}")
        (tmp / "haproxy.cfg").write_text(text)
        argv = [tool("haproxy"), "-db", "-f", str(tmp / "haproxy.cfg")]
    procs.spawn(kind, argv, {"PATH": "/usr/sbin:/usr/bin:/bin"})
    url = f"http://127.0.0.1:{port}"
    eventually(lambda: _ready(url), 30, f"{kind} to serve /ready")
    return kind, url


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(params=["nginx", "haproxy"])
def lb(request, fleet):
    kind, url = start_lb(fleet, request.param)
    yield url
    fleet["procs"].stop(kind)


def requests_served(router: str) -> float:
    return metric(router, "kimi_pd_router_requests_total")


def test_lb_streams_pd_requests_round_robin_and_hides_admin(fleet, lb):
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "stream": True, "temperature": 0}
    before = [requests_served(r) for r in fleet["routers"]]
    with httpx.stream("POST", lb + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        assert resp.headers["x-kimi-pd-prefill-worker"].startswith("prefill-127.0.0.1:")
        assert resp.headers["x-kimi-pd-decode-worker"].startswith("decode-127.0.0.1:")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert any(json.loads(e[6:]).get("choices") for e in events[:-1])
    short = {"model": "kimi-k3", "prompt": "hello", "max_tokens": 2}
    for _ in range(4):
        assert httpx.post(lb + "/v1/completions", json=short, timeout=60).status_code == 200
    served = [requests_served(r) - b for r, b in zip(fleet["routers"], before, strict=False)]
    assert sum(served) == 5 and min(served) >= 2, f"round robin over both nodes' routers: {served}"
    for path in ("/admin/workers", "/metrics", "/v1/../admin/workers", "/dashboard", "/dashboard/state"):
        assert httpx.get(lb + path, timeout=5).status_code == 404, path


def test_lb_routes_around_a_dead_router(fleet):
    """Last: stops node A's router for good."""
    _, url = start_lb(fleet, "nginx")
    _, url2 = start_lb(fleet, "haproxy")
    fleet["procs"].stop("router-a")
    body = {"model": "kimi-k3", "prompt": "hello", "max_tokens": 2}
    for lb_url in (url, url2):
        for _ in range(4):
            assert httpx.post(lb_url + "/v1/completions", json=body, timeout=60).status_code == 200
