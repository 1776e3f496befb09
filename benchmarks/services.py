"""Server processes for the router benchmarks: started from the repository root, ready when a URL
answers 200, stopped (TERM, then KILL) when the block ends, also on failure, and killed with the
benchmark (PR_SET_PDEATHSIG) so no server outlives it."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The host's CPU as /proc/cpuinfo names it ('' where it does not), for a result's machine record."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return ""


class BenchError(RuntimeError):
    """A reply that is not what the protocol promises, or a service that would not start."""


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if this process dies, so no server outlives a killed benchmark."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{url}: the process exited with {proc.returncode}\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise BenchError(f"{url}: not ready after {timeout_s:.0f} s\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def checkout_path(tree: Path, pythonpath: str) -> str:
    """PYTHONPATH for a process run from another checkout: its modules first, this checkout's dropped (a
    module missing there must fail, not come from here), the rest kept (where a host installed the
    dependencies by path)."""
    kept = [p for p in pythonpath.split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return os.pathsep.join([str(tree), *kept])


@contextlib.contextmanager
def service(name: str, args: list[str], ready_url: str, log_dir: Path, timeout_s: float,
            program: list[str] | None = None, cwd: Path = ROOT) -> Iterator[subprocess.Popen]:
    """Run `python <args>` (or `program + args`) from the repository root until the block ends; ready
    when ready_url is 200. Yields the process (its pid is what CPU and RSS are read from)."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        # no threads run here (asyncio.run joins its executor before returning), so preexec_fn is safe
        path = os.environ.get("PYTHONPATH", "")
        env = None if cwd == ROOT else {**os.environ, "PYTHONPATH": checkout_path(cwd, path)}
        proc = subprocess.Popen([*(program or [sys.executable]), *args], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509
    try:
        _wait_ready(proc, ready_url, timeout_s, log)
        yield proc
    finally:
        _stop(proc)


def stub_worker(role: str, port: int, args: argparse.Namespace, log_dir: Path):
    """A stub worker on the bare fast server (tests/stub_fast.py): its ceiling is above the routers'."""
    cmd = ["-m", "tests.stub_worker", "--port", str(port), "--role", role, "--tokens", str(args.tokens),
           "--token-delay-ms", str(args.token_delay_ms), "--fast"]
    return service(f"stub-{role}", cmd, f"http://127.0.0.1:{port}/health", log_dir, args.startup_timeout)


def knows_router_workers(tree: Path) -> bool:
    """Whether checkout `tree`'s router takes `--workers N` (from its flag definitions, without running it)."""
    cli = tree / "router" / "cli.py"
    return cli.is_file() and '"--workers"' in cli.read_text()


def router(port: int, threshold: int, prefill: str, decode: str, model: Path, args: argparse.Namespace,
           log_dir: Path, tree: Path = ROOT, name: str = "router", entry: tuple[str, ...] = ("-m", "kimi_pd")):
    """`kimi-pd router` of checkout `tree` over the two stubs with `--workers N`: a router that knows the flag
    defaults to one process per core, so it is always given; an older `--baseline-tree` that does not know it
    runs one process, and asking it for more is an error. `entry` runs the CLI (benchmarks/router_stages.py
    wraps it to cut the request path short)."""
    cmd = [*entry, "router", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--prefill", prefill, "--decode", decode, "--disagg-threshold", str(threshold), "--log-level", "warning"]
    if knows_router_workers(tree):
        cmd += ["--workers", str(args.router_workers)]
    elif args.router_workers > 1:
        raise BenchError(f"the router of {tree} has no --workers flag: it runs one process only")
    return service(f"{name}-t{threshold}", cmd, f"http://127.0.0.1:{port}/ready", log_dir, args.startup_timeout,
                   cwd=tree)


