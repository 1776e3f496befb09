"""Starting the processes a benchmark measures, and knowing when they serve: each in its own session (so a
whole process group can be stopped), with its output in a log file or discarded."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def spawn(argv: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """`argv` in a new session, its stdout and stderr appended to `log` (discarded without one)."""
    if log is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ok(url: str, timeout_s: float = 120.0, poll_s: float = 0.3) -> None:
    """Poll `url` until it answers 200; RuntimeError naming it after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready in {timeout_s:.0f} s")
