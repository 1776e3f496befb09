"""`kimi-pd up` leaves nothing behind when it is killed, refuses a port somebody else holds, and lowers a
nice child's whole session."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kimi_pd.processes import Processes
from kimi_pd.up import PortTaken, check_port_free

# A parent that spawns one long-lived child through Processes (as `kimi-pd up` does), prints the child's
# pid, then waits to be killed.
_PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kimi_pd.processes import Processes
    fleet = Processes()
    child = fleet.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], {}, Path(sys.argv[1]))
    print(child.popen.pid, flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"      # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "child.log")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)                      # no cleanup code runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_a_taken_port_is_refused_with_a_clear_message() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortTaken, match=f"port {port} .* already in use.*--port"):
            check_port_free(port)
    check_port_free(port)                                       # free again once the holder closed


def test_kimi_pd_up_exits_at_once_on_a_taken_port(tmp_path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "kimi_pd", "up", "--port", str(port),
                               "--log-dir", str(tmp_path / "logs")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"port {port}" in done.stderr and "already in use" in done.stderr
    assert "kimi-pd is up" not in done.stdout
    assert not (tmp_path / "logs" / "router.log").exists()     # nothing was started
    assert time.monotonic() - started < 60


def test_a_nice_child_is_lowered_as_a_session_too(tmp_path) -> None:
    """`spawn(..., nice=10)`: the process runs at niceness 10 and, where the kernel groups sessions
    (autogroup), its whole session does too, children included: a nice process alone in its own session
    would otherwise take as much CPU as the router beside it."""
    own = Path(f"/proc/{os.getpid()}/autogroup")
    own_before = own.read_text() if own.exists() else None
    fleet = Processes()
    # the child forks a grandchild (same session) and prints its pid
    child = fleet.spawn("nice", [sys.executable, "-c", "import subprocess, time; "
                                 "g = subprocess.Popen(['sleep', '60']); print(g.pid, flush=True); time.sleep(60)"],
                        dict(os.environ), tmp_path / "nice.log", nice=10)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "nice.log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int((tmp_path / "nice.log").read_text().split()[0])
        for pid in (child.popen.pid, grandchild):
            with open(f"/proc/{pid}/stat") as f:
                assert int(f.read().split(")")[-1].split()[16]) == 10, pid      # field 19: nice
        autogroup = Path(f"/proc/{child.popen.pid}/autogroup")
        if autogroup.exists() and Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
            assert autogroup.read_text().split()[-1] == "10"
            assert Path(f"/proc/{grandchild}/autogroup").read_text() == autogroup.read_text()
        assert (own.read_text() if own.exists() else None) == own_before        # the caller's group untouched
    finally:
        fleet.stop(grace_s=5)
