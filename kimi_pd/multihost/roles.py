"""The command line and environment of each role on its own host, as deploy/compose/roles/*.yml give
them (tests/deploy checks the two agree), from the same node variables (`node.env`): a worker binds
KIMI_PD_BIND and advertises KIMI_PD_HOST_ADDR, for its HTTP API and its KV transfer server alike."""
from __future__ import annotations

import os
import sys

KIMI_PD = [sys.executable, "-m", "kimi_pd"]
PREFILL_PORT, KV_PORT, DECODE_PORT, ROUTER_PORT, STORE_PORT, LB_PORT = 8101, 9101, 8201, 8000, 6379, 8000


def node_env(host_addr: str, redis_url: str, transfer_secret: str, admin_token: str, model_dir: str,
             bind: str = "0.0.0.0", namespace: str = "default") -> dict[str, str]:
    """The node.env variables of one host."""
    return {"KIMI_PD_HOST_ADDR": host_addr, "KIMI_PD_BIND": bind, "KIMI_PD_MODEL_DIR": model_dir,
            "KIMI_PD_REDIS_URL": redis_url, "KIMI_PD_TRANSFER_SECRET": transfer_secret,
            "KIMI_PD_ADMIN_TOKEN": admin_token, "KIMI_PD_API_KEYS": "", "KIMI_PD_PREFILL_PORT": str(PREFILL_PORT),
            "KIMI_PD_KV_PORT": str(KV_PORT), "KIMI_PD_DECODE_PORT": str(DECODE_PORT),
            "KIMI_PD_ROUTER_PORT": str(ROUTER_PORT), "KIMI_PD_KV_TRANSPORT": "tcp", "KIMI_PD_NAMESPACE": namespace}


def role_argv(role: str, env: dict[str, str]) -> list[str]:
    """`kimi-pd ROLE ...` exactly as the role's compose file runs it (the model mount: the model dir)."""
    model, bind, addr, ns = env["KIMI_PD_MODEL_DIR"], env["KIMI_PD_BIND"], env["KIMI_PD_HOST_ADDR"], \
        env["KIMI_PD_NAMESPACE"]
    if role == "router":
        return ["kimi-pd", "router", "--model", model, "--host", bind, "--port", env["KIMI_PD_ROUTER_PORT"],
                "--namespace", ns]
    port = env["KIMI_PD_PREFILL_PORT" if role == "prefill" else "KIMI_PD_DECODE_PORT"]
    argv = ["kimi-pd", role, "--model", model, "--host", bind, "--port", port,
            "--advertise-url", f"http://{addr}:{port}", "--worker-id", f"{role}-{addr}:{port}",
            "--kv-transport", env["KIMI_PD_KV_TRANSPORT"], "--kv-host", bind, "--kv-advertise-host", addr]
    if role == "prefill":
        return [*argv, "--kv-port", env["KIMI_PD_KV_PORT"], "--namespace", ns]
    return [*argv, "--kv-load-failure-policy", "recompute", "--namespace", ns]


def role_env(role: str, env: dict[str, str]) -> dict[str, str]:
    """The process environment: secrets and the store URL (with its password) never on argv."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_PD_")}
    out = {**base, "KIMI_PD_REDIS_URL": env["KIMI_PD_REDIS_URL"], "KIMI_PD_ADMIN_TOKEN": env["KIMI_PD_ADMIN_TOKEN"],
           "PYTHONUNBUFFERED": "1"}
    if role == "router":
        out["KIMI_PD_API_KEYS"] = env["KIMI_PD_API_KEYS"]
    else:
        out["KIMI_PD_TRANSFER_SECRET"] = env["KIMI_PD_TRANSFER_SECRET"]
    return out


def store_argv(bind: str, port: int) -> list[str]:
    """store.yml's entrypoint: the password reaches valkey-server on stdin, never on a command line."""
    script = ('printf \'requirepass "%s"\\n\' "$KIMI_PD_STORE_PASSWORD" | '
              'valkey-server - --bind "$1" --port "$2" --save "" --appendonly no --protected-mode no')
    return ["/bin/sh", "-c", script, "kimi-pd-store", bind, str(port)]


def haproxy_config(template: str, routers: list[str], port: int = LB_PORT, stats_socket: str | None = None) -> str:
    """deploy/lb/haproxy.cfg with its router list replaced by `routers` (ADDR:PORT each); `stats_socket`:
    a local admin socket too, so a rehearsal can see which routers the LB holds up or down."""
    lines, out = template.splitlines(), []
    for line in lines:
        if line.strip().startswith("server router-"):
            continue
        out.append(line.replace("bind :8000", f"bind :{port}"))
        if line.strip() == "global" and stats_socket:
            out.append(f"    stats socket {stats_socket} mode 600 level admin")
        if line.strip().startswith("default-server"):
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(f"{indent}server router-{i} {addr}" for i, addr in enumerate(routers, 1))
    return "\n".join(out) + "\n"
