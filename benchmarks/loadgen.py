"""A closed-loop HTTP load generator for the router benchmarks: `wrk` driven by a Lua script.

Why wrk: a Python client (httpx, aiohttp) tops out at a few hundred to ~2,600 requests/s on one
core here, below the routers it measures, so a requests/s figure would be the client's. wrk is C,
keeps every connection busy (each sends its next request as its reply ends), and reports latency
in microseconds. Its own CPU is read from this process's reaped-children usage, so a run says what
the generator cost next to what the target cost.

The script rotates through the given JSON bodies (a shared prefix and a per-request suffix, as the
benchmark makes them), POSTs them, and prints one JSON line from wrk's `done` hook: requests,
errors by kind (a non-2xx status counts as an error), and latency mean / p50 / p99 / max.
"""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "wrk is not installed: `apt-get install -y wrk` (Debian/Ubuntu package `wrk`)"

_LUA = """
local bodies = {%(bodies)s}
local reqs, i = {}, 0
function init(args)
  for k, b in ipairs(bodies) do
    reqs[k] = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, b)
  end
end
function request()
  i = i %% #reqs + 1
  return reqs[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRK_JSON {"requests":%%d,"duration_us":%%d,"connect":%%d,"read":%%d,"write":%%d,"status":%%d,' ..
    '"timeout":%%d,"mean_us":%%.1f,"p50_us":%%d,"p99_us":%%d,"max_us":%%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


class LoadGenError(RuntimeError):
    """wrk is missing, failed, or the target answered with errors."""


def wrk_binary() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise LoadGenError(INSTALL_HINT)
    return path


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_script(path: Path, bodies: list[dict[str, Any]]) -> Path:
    """A wrk script POSTing `bodies` in turn (compact JSON)."""
    encoded = [_lua_string(json.dumps(b, separators=(",", ":"))) for b in bodies]
    path.write_text(_LUA % {"bodies": ",\n".join(encoded)})
    return path


@dataclass(frozen=True)
class Run:
    """One wrk run against one URL."""

    requests: int
    seconds: float
    errors: dict[str, int]
    mean_us: float
    p50_us: int
    p99_us: int
    max_us: int
    generator_cpu_s: float            # wrk's own user + system CPU seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_wrk(url: str, script: Path, connections: int, seconds: int, threads: int | None = None,
            timeout_s: float = 10.0) -> Run:
    """`connections` closed-loop clients for `seconds` (threads: 1 per 16 connections, at most 2)."""
    threads = threads or min(2, max(1, connections // 16))
    cmd = [wrk_binary(), f"-t{threads}", f"-c{connections}", f"-d{seconds}s", f"--timeout={timeout_s:g}s",
           "-s", str(script), url]
    before = _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + timeout_s + 30, check=False)
    cpu = _children_cpu() - before
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise LoadGenError(f"wrk failed ({proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")
    out = json.loads(line.removeprefix("WRK_JSON "))
    errors = {k: out[k] for k in ("connect", "read", "write", "status", "timeout") if out[k]}
    return Run(requests=out["requests"], seconds=out["duration_us"] / 1e6, errors=errors, mean_us=out["mean_us"],
               p50_us=out["p50_us"], p99_us=out["p99_us"], max_us=out["max_us"], generator_cpu_s=cpu)
