"""Child processes of `kimi-pd up` (and of the end-to-end tests): each in its own session, output to
a log file, stopped together (SIGTERM to its process group, then SIGKILL after a grace period)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal_group(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Processes:
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> Child:
        with open(log, "ab") as out:
            popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def dead(self) -> list[str]:
        return [f"{c.name} (exit {c.popen.returncode})" for c in self.children if c.popen.poll() is not None]

    def stop(self, grace_s: float = 15.0) -> None:
        for child in self.children:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
                child.popen.wait(5)
