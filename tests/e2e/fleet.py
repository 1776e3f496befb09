"""Real processes for end-to-end tests: workers and routers on loopback, free ports, bounded waits.

Every process is started in its own session and stopped (SIGTERM, then SIGKILL) when the fleet
closes, also when a test fails. Logs go to files under the test's tmp dir; a failed wait prints
the tail of the process's log so the cause is visible in CI output.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kimi_pd.processes import Child, Processes
from kimi_pd.up import KIMI_PD
from shared.net import free_port

SECRET = "e2e-transfer-secret-0123456789abcdef"
ADMIN = "e2e-admin-token"
WORKER_ARGS = ["--block-size", "4", "--kda-chunk-size", "8", "--cache-memory", "8MiB", "--heartbeat-s", "0.2",
               "--max-num-seqs", "8", "--log-level", "warning"]
ROUTER_ARGS = ["--health-check-interval", "0.3", "--refresh-interval", "0.2", "--connect-timeout", "1",
               "--log-level", "warning"]


def eventually(check, timeout_s: float = 20.0, what: str = "condition"):
    """Poll `check` until it returns something truthy (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Proc:
    child: Child
    url: str

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def popen(self) -> subprocess.Popen:
        return self.child.popen

    def tail(self, n: int = 40) -> str:
        return self.child.tail(n)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.child.signal_group(sig)
            self.popen.wait(10)


class Fleet:
    def __init__(self, tmp: Path, model_dir: Path, redis_url: str | None = None, namespace: str = "e2e") -> None:
        self.tmp, self.model_dir, self.redis_url, self.namespace = tmp, model_dir, redis_url, namespace
        self.procs: list[Proc] = []
        self.processes = Processes()
        self.env = {**os.environ, "KIMI_PD_TRANSFER_SECRET": SECRET, "KIMI_PD_ADMIN_TOKEN": ADMIN,
                    "PYTHONUNBUFFERED": "1"}

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> Proc:
        child = self.processes.spawn(name, cmd, {**self.env, **(env or {})}, self.tmp / f"{name}.log")
        proc = Proc(child, f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        return proc

    def _store_args(self) -> list[str]:
        return ["--redis-url", self.redis_url, "--namespace", self.namespace] if self.redis_url else []

    def worker(self, role: str, name: str, *extra: str) -> Proc:
        port = free_port()
        argv = [role, "--model", str(self.model_dir), "--port", str(port), "--worker-id", name, *WORKER_ARGS,
                *self._store_args(), *extra]
        return self._spawn(name, [*KIMI_PD, *argv], port)

    def stub(self, role: str, name: str, *extra: str) -> Proc:
        """A model-free OpenAI stub worker (tests/stub_worker.py) with deterministic timings."""
        port = free_port()
        cmd = [sys.executable, "-m", "tests.stub_worker", "--port", str(port), "--role", role, *extra]
        return self._spawn(name, cmd, port)

    def router(self, name: str, *extra: str, port: int | None = None, env: dict[str, str] | None = None) -> Proc:
        port = port or free_port()
        argv = ["router", "--model", str(self.model_dir), "--port", str(port), *ROUTER_ARGS, *self._store_args(),
                *extra]
        return self._spawn(name, [*KIMI_PD, *argv], port, env)

    def wait(self, proc: Proc, path: str = "/health", timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            try:
                if httpx.get(proc.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{proc.name} not ready at {path} after {timeout_s} s:\n{proc.tail()}")

    def static_pd(self, prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
                  router_flags: tuple[str, ...] = ()) -> Fleet:
        """One prefill worker, one decode worker and a router that always disaggregates, all ready and the
        router listing both healthy; they are `self.p`, `self.d`, `self.r`. The three start at once (the
        router's health checks find the workers when they are up), which saves the router's start-up time
        on every fleet."""
        p, d = self.worker("prefill", "p0", *prefill_flags), self.worker("decode", "d0", *decode_flags)
        r = self.router("r0", "--prefill", p.url, "--decode", d.url, "--disagg-threshold", "0", *router_flags)
        for proc in (p, d):
            self.wait(proc)
        self.wait(r, "/ready")
        wait_listed(r, p, d)
        self.p, self.d, self.r = p, d, r
        return self

    def close(self) -> None:
        self.processes.stop()


def offline_llm(model_dir: Path):
    """The colocated reference the e2e fleets are compared with: the workers' cache geometry."""
    from engine import LLM
    return LLM(str(model_dir), block_size=4, kda_chunk_size=8, cache_memory_bytes=8 << 20)


def greedy_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """An offline engine's greedy token ids for token-id prompts, decoded past EOS: what every P/D pairing
    must answer."""
    from engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.output.token_ids for o in outs]


def greedy_reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`greedy_ids` from a colocated engine with the workers' cache geometry, closed after."""
    with offline_llm(model_dir) as llm:
        return greedy_ids(llm, prompts, max_tokens)


def completion_ids_body(prompt: list[int], max_tokens: int) -> dict:
    """A greedy /v1/completions body for a token-id prompt, decoded past EOS, answering its token ids."""
    return {"model": "kimi-k3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def complete_ids(router_url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(router_url + "/v1/completions", json=completion_ids_body(prompt, max_tokens), timeout=120)


def healthy_workers(router: Proc) -> set[str]:
    """The worker URLs the router's admin view lists as healthy."""
    listed = httpx.get(router.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
    return {w["url"] for w in listed.json()["workers"] if w["healthy"]}


def raw_post(url: str, path: str, body: bytes, extra_header: bytes) -> bytes:
    """POST JSON with header lines httpx refuses to build (a NUL or raw UTF-8 in a value; several lines may
    be joined with CRLF); the reply's status line."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + extra_header + b"\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\nconnection: close\r\n\r\n" + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply.split(b"\r\n", 1)[0]


def wait_listed(router: Proc, prefill: Proc, decode: Proc) -> None:
    """Until `router` lists both its workers healthy: /ready needs only the decode worker, and the prefill
    worker is placed once the router's health check passed it."""
    eventually(lambda: healthy_workers(router) == {prefill.url, decode.url}, timeout_s=60,
               what=f"{router.name} to list {prefill.name} and {decode.name}")


def pd_routers(fleet: Fleet, pairs: dict[str, tuple[Proc, Proc]]) -> list[Proc]:
    """One always-disaggregating router per named (prefill, decode) pair, started together, each ready and
    listing both its workers healthy (/ready needs only the decode worker; the prefill worker is placed
    once the router's health check passed it)."""
    routers = [fleet.router(name, "--prefill", p.url, "--decode", d.url, "--disagg-threshold", "0")
               for name, (p, d) in pairs.items()]
    for router, (prefill, decode) in zip(routers, pairs.values(), strict=True):
        fleet.wait(router, "/ready")
        wait_listed(router, prefill, decode)
    return routers


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample (matching labels) from `url`/metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@contextlib.contextmanager
def kimi_pd_up(args: list[str], log_dir: Path, env: dict | None = None,
               timeout_s: float = 180.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kimi-pd up ARGS` on a free loopback port until it prints its curl line; yields (url, process).

    On exit it is stopped with SIGTERM (killed if it has not gone in 60 s), also when the test failed.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", "up", *args, "--port", str(port),
                             "--log-dir", str(log_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        deadline, lines = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("curl"):
                break
        assert any("kimi-pd is up" in line for line in lines), "".join(lines)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
