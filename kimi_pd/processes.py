"""Child processes of `kimi-pd up` (and of the end-to-end tests): each in its own session, output to
a log file, stopped together (SIGTERM to its process group, then SIGKILL after a grace period), and sent
SIGTERM by the kernel if their parent dies without stopping them (a supervisor killed with SIGKILL leaves
no orphans serving on its ports)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.lifetime import die_with_parent_hook


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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)


AUTOGROUP = "/proc/{pid}/autogroup"


def lower_priority(session_leader: int, nice: int) -> None:
    """Give the session that `session_leader` heads the niceness `nice` as a whole. With Linux's
    autogroup (on by default on desktops and many VMs) each session is one scheduling group and the groups
    share the CPUs equally, whatever their processes' own niceness: a nice-10 child in its own session takes
    as much CPU as the router beside it. Raising a group's niceness needs no privilege. Where there is no
    autogroup to set, the process's own niceness (set by `nice`) is what counts, and this does nothing."""
    with contextlib.suppress(OSError), open(AUTOGROUP.format(pid=session_leader), "w") as f:
        f.write(str(nice))


@dataclass
class Processes:
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], log: Path, nice: int = 0) -> Child:
        """Start `cmd` in its own session. `nice` > 0 lowers its CPU priority against the caller's other
        children: see `lower_priority`."""
        with open(log, "ab") as out:
            popen = subprocess.Popen(["nice", "-n", str(nice), *cmd] if nice else cmd, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent_hook(signal.SIGTERM))
        if nice:
            lower_priority(popen.pid, nice)
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


@dataclass(frozen=True)
class Backoff:
    """Restart delays: `first_s`, doubling up to `max_s`; a child that ran `reset_after_s` without
    dying starts again from `first_s` (a crash loop backs off, a rare crash restarts at once)."""

    first_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, restarts_in_a_row: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, restarts_in_a_row - 1))


@dataclass
class _Supervised:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    child: Child
    started_at: float
    restarts_in_a_row: int = 0
    restarts: int = 0
    restart_at: float | None = None


class Supervisor:
    """Keeps every child of `kimi-pd up` running: a child that exits is started again (same command,
    so the same port and worker id) after a backoff, and each exit and restart is reported through
    `report` (stderr in `kimi-pd up`); the others keep serving meanwhile."""

    def __init__(self, processes: Processes, backoff: Backoff = Backoff(), report=print,
                 clock=time.monotonic) -> None:
        self.processes, self.backoff, self.report, self._clock = processes, backoff, report, clock
        self._children: dict[str, _Supervised] = {}

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> Child:
        child = self.processes.spawn(name, cmd, env, log)
        self._children[name] = _Supervised(name, cmd, env, log, child, self._clock())
        self.report(f"kimi-pd: started {name} (pid {child.popen.pid}, log: {log})")
        return child

    def restarts(self, name: str) -> int:
        return self._children[name].restarts

    def retire(self, name: str) -> None:
        """Stop supervising `name` and SIGTERM it (a worker drains, then exits); never restarted.
        The process stays in `processes`, so stopping the fleet still waits for it."""
        s = self._children.pop(name)
        s.child.signal_group(signal.SIGTERM)
        self.report(f"kimi-pd: retiring {name} (pid {s.child.popen.pid}): drains, then exits")

    def names(self) -> list[str]:
        return list(self._children)

    def poll(self) -> None:
        """One supervision round: notice exits, schedule restarts, start those that are due."""
        now = self._clock()
        for s in self._children.values():
            code = s.child.popen.poll()
            if code is None or s.restart_at is not None and now < s.restart_at:
                continue
            if s.restart_at is None:                               # just noticed the exit
                ran = now - s.started_at
                s.restarts_in_a_row = 1 if ran >= self.backoff.reset_after_s else s.restarts_in_a_row + 1
                delay = self.backoff.delay(s.restarts_in_a_row)
                s.restart_at = now + delay
                self.report(f"kimi-pd: {s.name} exited (code {code}) after {ran:.1f} s; "
                            f"restarting in {delay:.1f} s (log: {s.log})")
                continue
            self.processes.children.remove(s.child)
            s.child = self.processes.spawn(s.name, s.cmd, s.env, s.log)
            s.started_at, s.restart_at = now, None
            s.restarts += 1
            self.report(f"kimi-pd: restarted {s.name} (pid {s.child.popen.pid}, restart {s.restarts})")
