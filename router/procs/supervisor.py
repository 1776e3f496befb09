"""The parent of `kimi-pd router --workers N`: binds the port once, starts N router processes that accept
on the inherited socket, restarts any that dies, and on SIGTERM/SIGINT stops them all within the grace.

One socket bound by the parent rather than SO_REUSEPORT sockets per child (docs/router-processes.md): a
connection queued on a dying child's own SO_REUSEPORT socket is reset with it, while on the shared
socket it waits for a sibling; port 0 and a busy port fail once, in the parent; and nothing else on the
host can join the port. The children are `multiprocessing` spawn processes (a fresh interpreter each: no
forked event loop or thread state), handed the socket, the table's path and its lock.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.procs.share import READY
from router.procs.table import SharedTable

log = logging.getLogger("router.procs")


@dataclass(frozen=True)
class ChildSpec:
    """What a child needs besides the router's flags: who it is and where the shared state lives."""

    index: int
    nprocs: int
    table_path: str
    group: str                                        # this router's id prefix in the store's shared view
    grace_s: float


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a port in TIME_WAIT is free, as uvicorn does
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _run_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="kimi-pd-router-", dir=base)


class Supervisor:
    """Owns the children; `run` blocks until a signal (or a start-up failure) and returns the exit code."""

    def __init__(self, args: argparse.Namespace, model_dir: str | None, nprocs: int, grace_s: float,
                 serve: Callable[..., None]) -> None:
        self.args, self.model_dir, self.nprocs, self.grace_s, self.serve = args, model_dir, nprocs, grace_s, serve
        self.ctx = mp.get_context("spawn")
        self.run_dir = _run_dir()
        self.table = SharedTable.create(os.path.join(self.run_dir, "table"), nprocs, self.ctx.Lock())
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        os.makedirs(self.metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir     # the children inherit it (metrics.py)
        self.group = f"r{os.getpid()}-{os.urandom(3).hex()}"
        self.children: list[Any] = [None] * nprocs
        self.backoff_s = [0.5] * nprocs
        self.due: dict[int, float] = {}               # child -> when to start it again
        self.stopping = False

    def start(self, index: int, sock: socket.socket) -> None:
        spec = ChildSpec(index, self.nprocs, self.table.path, self.group, self.grace_s)
        proc = self.ctx.Process(target=child_main, name=f"router-{index}",
                                args=(self.args, self.model_dir, sock, spec, self.table.lock, self.serve))
        proc.start()
        self.children[index] = proc
        log.info("router process %d started (pid %d)", index, proc.pid)

    def run(self, sock: socket.socket) -> int:
        def on_signal(signum, frame) -> None:
            self.stopping = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        try:
            for i in range(self.nprocs):
                self.start(i, sock)
            log.info("router on %s:%d: %d processes (parent pid %d)", self.args.host, sock.getsockname()[1],
                     self.nprocs, os.getpid())
            while not self.stopping:
                if self.poll(sock):
                    return 1
                # until a child exits (its sentinel), a restart is due, or a signal's next check
                sentinels = [p.sentinel for p in self.children if p is not None]
                mp.connection.wait(sentinels, timeout=0.5 if not self.due else 0.1)
            return 0
        finally:
            self.stop()
            sock.close()
            self.table.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def poll(self, sock: socket.socket) -> bool:
        """Restart dead children (with a growing back-off while they die young); True: give up, the router
        never started (a bad flag, a refused worker: restarting would fail the same way)."""
        now = time.monotonic()
        for i, proc in enumerate(self.children):
            if proc is not None and not proc.is_alive():
                if not any(self.table.proc(j, READY) for j in range(self.nprocs)):
                    log.error("router process %d exited with %s before any process was ready: stopping", i,
                              proc.exitcode)
                    return True
                self._buried(i, proc)
                self.due[i] = now + self.backoff_s[i]
                self.backoff_s[i] = min(self.backoff_s[i] * 2, 10.0)
            if i in self.due and now >= self.due[i]:
                del self.due[i]
                self.start(i, sock)
            elif proc is not None and proc.is_alive() and self.table.proc(i, READY):
                self.backoff_s[i] = 0.5                  # up and serving again: a later death restarts at once
        return False

    def _buried(self, index: int, proc: Any) -> None:
        from prometheus_client import multiprocess
        log.warning("router process %d (pid %d) exited with %s; restarting it", index, proc.pid, proc.exitcode)
        self.table.clear_proc(index)                    # its in-flight legs ended with it
        self.table.count_restart()
        multiprocess.mark_process_dead(proc.pid, self.metrics_dir)
        self.children[index] = None

    def stop(self) -> None:
        """SIGTERM to every child (each drains its streams), SIGKILL to those still up after the grace."""
        alive = [p for p in self.children if p is not None and p.is_alive()]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in alive:
            if proc.is_alive():
                log.warning("router process %s (pid %d) still up after %.0f s: killed", proc.name, proc.pid,
                            self.grace_s)
                proc.kill()
                proc.join(5)
        log.info("router stopped (%d processes)", len(alive))


def run_processes(args: argparse.Namespace, model_dir: str | None, nprocs: int, grace_s: float,
                  serve: Callable[..., None]) -> int:
    """`serve(args, model_dir, share=, sockets=, grace_s=)` runs one router process (router/cli.py)."""
    sock = bind(args.host, args.port)
    return Supervisor(args, model_dir, nprocs, grace_s, serve).run(sock)


def _die_with_parent() -> None:
    """Linux: SIGKILL this child when the parent dies. A killed parent must not leave orphans serving, nor
    children draining on the port while the parent's restart (systemd, Kubernetes) tries to bind it."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def child_main(args: argparse.Namespace, model_dir: str | None, sock: socket.socket, spec: ChildSpec,
               lock: Any, serve: Callable[..., None]) -> None:
    """One router process: the app on the inherited socket, its placement state shared through the table."""
    _die_with_parent()
    from shared.logs import LOG_FORMAT, configure_logging
    configure_logging(args.log_level, LOG_FORMAT.replace("%(name)s", f"router[{spec.index}] pid {os.getpid()} "
                                                                     "%(name)s"))
    from router.procs.share import ProcessShare
    table = SharedTable.attach(spec.table_path, lock)
    share = ProcessShare(table, spec.index, group=spec.group)
    serve(args, model_dir, share=share, sockets=[sock], grace_s=spec.grace_s)
