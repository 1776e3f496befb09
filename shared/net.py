"""Ports for the processes the project starts (servers, ranks, tests), handed out so they cannot be raced.

A port the kernel picks with bind(port 0) comes from its ephemeral range, and any outgoing connection on the
host can take it as a source port before the process it was meant for binds it: CI lost runs to exactly
that ("address already in use" from a worker started beside data-parallel ranks, a NIXL side channel).
Below that range only another listener can take a port, so ports are handed out from there, each one
bind-checked and never given twice by this process.
"""
from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST_PLANNED_PORT = 20000
"""Ports below this are left alone: well-known services and the defaults operators configure live there."""


def ephemeral_low(range_file: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read, Linux's default)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind `port` on `host` now (without SO_REUSEADDR: a port in TIME_WAIT is not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class PortPlan:
    """Listening ports between `low` and the kernel's ephemeral range, never handed out twice.

    Picks are random so that two processes planning at once (two test sessions, `up` beside a test) rarely
    try the same port, and each pick is bind-checked, so a port some listener holds is skipped.
    """

    def __init__(self, low: int = LOWEST_PLANNED_PORT, high: int | None = None) -> None:
        self.low = low
        self.high = ephemeral_low() - 1 if high is None else high
        self.given: set[int] = set()
        self.rng = random.Random()
        self.lock = threading.Lock()

    @property
    def usable(self) -> bool:
        """False on a host whose ephemeral range starts too low to leave room below it."""
        return self.high - self.low >= 1000

    def block(self, count: int = 1, host: str = "127.0.0.1") -> int:
        """The first of `count` consecutive ports, each free on `host` now."""
        with self.lock:
            for _ in range(200):
                first = self.rng.randrange(self.low, self.high - count + 1)
                ports = range(first, first + count)
                if not self.given.intersection(ports) and all(bindable(port, host) for port in ports):
                    self.given.update(ports)
                    return first
        raise RuntimeError(f"no {count} consecutive free ports in {self.low}-{self.high}")


PLAN = PortPlan()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, from below the ephemeral range (see the module's docstring).

    Where the host leaves no room below its ephemeral range, the kernel's pick, which can be raced.
    """
    if PLAN.usable:
        return PLAN.block(1, host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
