"""The routers ours is measured against, started side by side on loopback: nginx (a plain reverse
proxy, the floor), vllm-router and sglang-router (Rust, from PyPI into a venv made here).

Each peer is a command line plus a ready URL; `proc_usage` reads a process tree's CPU seconds and
RSS from /proc, so every router is charged the same way (nginx's master + worker, the Rust
routers' threads, our uvicorn process).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")
VENV = Path(os.environ.get("KIMI_PD_PEERS_VENV", Path.home() / ".cache" / "kimi-pd-bench" / "peers"))
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Peer:
    name: str
    program: list[str]
    args: list[str]
    ready_path: str


def ensure_venv(venv: Path = VENV) -> Path | None:
    """A venv holding the peer routers (made and filled from PyPI on first use); None if pip fails."""
    bin_dir = venv / "bin"
    if all((bin_dir / tool).exists() for tool in ("vllm-router", "sglang-router")):
        return bin_dir
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *PEER_PACKAGES], check=True, timeout=1200)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"peers: could not install {PEER_PACKAGES}: {exc}", file=sys.stderr)
        return None
    return bin_dir


def nginx_conf(tmp: Path, port: int, upstream: str) -> Path:
    """One worker process, keep-alive to the upstream, no buffering (SSE passes through as sent)."""
    host = upstream.removeprefix("http://")
    conf = tmp / f"nginx-{port}.conf"
    conf.write_text(f"""
daemon off;
master_process on;
worker_processes 1;
pid {tmp}/nginx-{port}.pid;
error_log {tmp}/nginx-{port}.error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body; proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fcgi; uwsgi_temp_path {tmp}/nginx-uwsgi; scgi_temp_path {tmp}/nginx-scgi;
    upstream worker {{ server {host}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://worker;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            tcp_nodelay on;
        }}
    }}
}}
""")
    return conf


def peers_for(mode: str, prefill_url: str, decode_url: str, ports: dict[str, int], tmp: Path,
              bin_dir: Path | None) -> list[Peer]:
    """The peers that can serve `mode` against the stubs (nginx: decode-only only)."""
    peers: list[Peer] = []
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if mode == "decode-only" and nginx:
        conf = nginx_conf(tmp, ports["nginx"], decode_url)
        peers.append(Peer("nginx", [nginx], ["-c", str(conf), "-e", str(tmp / "nginx-stderr.log")], "/health"))
    if bin_dir is None:
        return peers
    common = ["--host", "127.0.0.1", "--log-level", "warning"]
    if mode == "decode-only":
        peers.append(Peer("vllm-router", [str(bin_dir / "vllm-router")],
                          [*common, "--port", str(ports["vllm-router"]), "--worker-urls", decode_url,
                           "--prometheus-port", str(ports["vllm-router-prom"])], "/health"))
        peers.append(Peer("sglang-router", [str(bin_dir / "sglang-router")],
                          ["launch", "--host", "127.0.0.1", "--port", str(ports["sglang-router"]), "--log-level",
                           "warn", "--worker-urls", decode_url, "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(ports["sglang-router-prom"])], "/health"))
    else:
        peers.append(Peer("vllm-router", [str(bin_dir / "vllm-router")],
                          [*common, "--port", str(ports["vllm-router"]), "--vllm-pd-disaggregation",
                           "--prefill", prefill_url, "--decode", decode_url,
                           "--prometheus-port", str(ports["vllm-router-prom"])], "/health"))
        # SGLang's P/D sends the request to both workers at once (its bootstrap fields, no
        # kv_transfer_params): the stubs serve both as ordinary requests, so it runs, but its two
        # legs overlap where ours and vllm-router's run one after the other
        peers.append(Peer("sglang-router", [str(bin_dir / "sglang-router")],
                          ["launch", "--host", "127.0.0.1", "--port", str(ports["sglang-router"]), "--log-level",
                           "warn", "--pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["sglang-router-prom"])],
                          "/health"))
    return peers


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds user+system, RSS bytes) of a process and its descendants."""
    cpu, rss, stack = 0.0, 0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLK_TCK
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
        stack.extend(_children(p))
    return cpu, rss
