"""Hosts made of Linux network namespaces: one namespace per host, each with one veth into a bridge
that lives in a namespace of its own (the "switch"), so nothing touches the caller's own network.

A host's link can be set down (a partition: packets vanish, connections stall, nobody gets a reset)
and capped with `tc tbf`. Everything is named with a per-run prefix and torn down by `close()`,
which also kills whatever still runs inside the namespaces. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
SUBNET = "10.77.0"                     # a private /24 that exists only on the bridge


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can): the reason a test skips with."""
    if os.geteuid() != 0:
        return "multi-host tests need root to create network namespaces (ip netns), and this is not root"
    probe = f"kpprobe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run `ip netns`: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str                 # the namespace's name
    addr: str               # its address on the bridge
    peer: str               # its veth's other end, on the bridge (in the switch namespace)

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def pids(self) -> list[str]:
        """Processes running inside this host."""
        return _ip("netns", "pids", self.ns, check=False).stdout.split()

    def run(self, cmd: list[str], timeout: float = 30.0) -> str:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, check=True, timeout=timeout).stdout


@dataclass
class Network:
    """A bridge and the hosts on it; `close()` (or the context manager) removes every trace."""

    prefix: str = field(default_factory=lambda: f"kp{secrets.token_hex(3)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    switch: str = ""

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> Network:
        self.switch = f"{self.prefix}-sw"
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add_host(self, name: str, octet: int) -> Host:
        """A namespace with loopback up and eth0 at 10.77.0.<octet>/24 on the bridge."""
        if not self.switch:
            self.open()
        host = Host(name, f"{self.prefix}-{name}", f"{SUBNET}.{octet}", f"v{octet}")
        _ip("netns", "add", host.ns)
        self.hosts[name] = host
        _ip("-n", self.switch, "link", "add", host.peer, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", self.switch, "link", "set", host.peer, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.peer, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        return host

    def set_link(self, name: str, up: bool) -> None:
        """Plug or unplug a host's cable: down is a partition (no reset, no error, just silence)."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].peer, "up" if up else "down")

    def cap(self, name: str, rate: str = "100mbit", burst: str = "256kb") -> None:
        """Cap what the host sends (and receives) with a token bucket, e.g. 100mbit (burst: bytes sent at once)."""
        host = self.hosts[name]
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.peer)):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", "400ms"], check=True, capture_output=True, timeout=30)

    def uncap(self, name: str) -> None:
        host = self.hosts[name]
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.peer)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    def close(self) -> None:
        """Kill what still runs inside, then delete every namespace (their veths and the bridge go with them)."""
        names = [h.ns for h in self.hosts.values()] + ([self.switch] if self.switch else [])
        for ns in names:
            _kill_inside(ns)
        for ns in names:
            _ip("netns", "del", ns, check=False)
        self.hosts.clear()
        self.switch = ""


def _kill_inside(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline and _ip("netns", "pids", ns, check=False).stdout.split():
        time.sleep(0.05)


def leftover_namespaces(prefix: str) -> list[str]:
    """Namespaces of a run (by its prefix) that still exist: none after `close()`."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the calling thread's new sockets inside namespace `ns` (setns on this thread only), e.g. a
    test's HTTP client acting as a host on the bridge. Sockets keep their namespace after the block."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the caller's namespace failed")
    finally:
        os.close(target)
        os.close(own)
