"""Chaos run: a `kimi-pd up` fleet (router, 1 prefill + 2 decode workers, embedded store) under mixed traffic
while a seeded schedule injects a fault every 20-40 s.

Traffic: chat and completions, streamed and whole, P/D (long prompts) and decode-only (short ones), greedy and
seeded, tools, an image, structured output, and clients that leave mid-stream. Every request asks for its token
ids. Each distinct request is answered once before the first fault: that answer is its reference.

Faults (the fleet's supervisor, `kimi-pd up`, restarts what dies), in a seeded order that has every kind once in
each run of five: SIGKILL of a decode worker, of the prefill worker, of the router or of the store; SIGSTOP of a
decode worker for 8 s. A transfer cut between hosts needs the
namespace harness (tests/multihost covers it); it is not part of this single-host run.

Invariants, checked for every request:
- a 200 is exactly the reference answer (whole: its token ids; streamed: the ids of every chunk, ended by
  `[DONE]` with a finish reason);
- every failure is explicit: an HTTP error status, an SSE `error` event, or a broken connection (a killed router
  cannot say more); never a stream that ends cleanly without `[DONE]` (a silent truncation), never a request that
  hangs past the router's idle timeout;
- at the end, with the fleet back to full strength: no prefill state held, no request running or waiting, no
  KV page in use on any worker.

    python -m benchmarks.chaos --minutes 10      # results/chaos.json
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ADMIN = "chaos-admin-token-0123456789"
IDLE_TIMEOUT_S = 60.0                       # the router's default: no stream may be silent longer
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ChaosConfig:
    minutes: float = 10.0
    seed: int = 0
    fault_every_s: tuple[float, float] = (20.0, 40.0)
    clients: int = 3
    stop_s: float = 8.0                      # how long a SIGSTOPped worker stays stopped
    recover_timeout_s: float = 120.0         # the fleet back to full strength after the last fault


@dataclass
class Outcome:
    kind: str                                # ok | http_error | sse_error | connection_error | cancelled | violation
    spec: str
    detail: str = ""


@dataclass
class Report:
    config: dict[str, Any]
    outcomes: Counter = field(default_factory=Counter)
    violations: list[dict[str, str]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    end_state: dict[str, Any] = field(default_factory=dict)
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "outcomes": dict(self.outcomes), "requests": sum(self.outcomes.values())}


# ---- the traffic ---------------------------------------------------------------------------------

def _png(seed: int) -> str:
    from PIL import Image
    rng = random.Random(seed)
    image = Image.new("RGB", (56, 42), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


LONG = "The lighthouse keeper counted the boats that came home before the storm, one by one. " * 6
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def request_specs() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (path, body): the distinct requests of the mix (P/D for long prompts, decode-only for short)."""
    chat = "/v1/chat/completions"
    base = {"model": "kimi-k3", "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}

    def msg(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]
    return {
        "pd-greedy": (chat, {**base, "messages": msg(LONG + "Tell the story."), "temperature": 0}),
        "pd-seeded": (chat, {**base, "messages": msg(LONG + "Go on."), "temperature": 1.0, "seed": 5}),
        "short-greedy": (chat, {**base, "messages": msg("Ping?"), "temperature": 0}),
        "short-seeded": (chat, {**base, "messages": msg("Pong?"), "temperature": 0.8, "seed": 9}),
        "completion": ("/v1/completions", {**base, "prompt": LONG, "temperature": 0}),
        "tools": (chat, {**base, "messages": msg("Weather in Paris?"), "tools": [WEATHER], "temperature": 0}),
        "json": (chat, {**base, "messages": msg("A JSON object, please."), "temperature": 0,
                        "response_format": {"type": "json_object"}}),
        "image": (chat, {**base, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": _png(1)}}]}]}),
    }


def token_ids_of_whole(body: dict[str, Any]) -> list[int]:
    choice = body["choices"][0]
    return list(choice.get("token_ids") or [])


def read_stream(resp: httpx.Response, cancel_after: int | None) -> tuple[str, list[int]]:
    """('done' | 'error' | 'truncated' | 'cancelled', token ids) of a streamed answer."""
    ids: list[int] = []
    events = 0
    error = done = False
    for line in resp.iter_lines():
        if line.startswith("event: error"):
            error = True
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            events += 1
            for choice in json.loads(line[6:]).get("choices", []):
                ids += choice.get("token_ids") or []
            if cancel_after is not None and events >= cancel_after:
                return "cancelled", ids
    return ("error" if error else "done" if done else "truncated"), ids


# ---- one request ---------------------------------------------------------------------------------

class Traffic:
    def __init__(self, url: str, specs: dict[str, tuple[str, dict[str, Any]]]) -> None:
        self.url, self.specs = url, specs
        self.reference: dict[str, list[int]] = {}
        self.timeout = httpx.Timeout(10.0, read=IDLE_TIMEOUT_S + 15.0)

    def record_references(self) -> None:
        for name, (path, body) in self.specs.items():
            resp = httpx.post(self.url + path, json=body, timeout=self.timeout)
            resp.raise_for_status()
            self.reference[name] = token_ids_of_whole(resp.json())
            if not self.reference[name]:
                raise RuntimeError(f"{name}: the reference answer carries no token ids")

    def one(self, name: str, stream: bool, cancel: bool) -> Outcome:
        path, body = self.specs[name]
        try:
            if stream:
                return self._stream(name, path, body, cancel)
            return self._whole(name, path, body)
        except httpx.TimeoutException as exc:
            return Outcome("violation", name, f"hang: no answer within the idle timeout ({exc!r})")
        except httpx.TransportError as exc:
            return Outcome("connection_error", name, repr(exc))

    def _whole(self, name: str, path: str, body: dict[str, Any]) -> Outcome:
        resp = httpx.post(self.url + path, json=body, timeout=self.timeout)
        if resp.status_code != 200:
            return self._error(name, resp.status_code, resp.content)
        ids = token_ids_of_whole(resp.json())
        if ids != self.reference[name]:
            return Outcome("violation", name, f"whole answer differs: {len(ids)} ids vs {len(self.reference[name])}")
        return Outcome("ok", name)

    def _stream(self, name: str, path: str, body: dict[str, Any], cancel: bool) -> Outcome:
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, timeout=self.timeout) as resp:
            if resp.status_code != 200:
                return self._error(name, resp.status_code, resp.read())
            end, ids = read_stream(resp, 3 if cancel else None)
        if end == "cancelled":
            return Outcome("cancelled", name)
        if end == "error":
            return Outcome("sse_error", name)
        if end == "truncated":
            return Outcome("violation", name, "silent truncation: the stream ended without [DONE] or an error")
        if ids != self.reference[name]:
            return Outcome("violation", name, f"stream differs: {len(ids)} ids vs {len(self.reference[name])}")
        return Outcome("ok", name)

    @staticmethod
    def _error(name: str, status: int, content: bytes) -> Outcome:
        try:
            explicit = status >= 400 and "error" in json.loads(content)
        except ValueError:
            explicit = False
        return Outcome("http_error" if explicit else "violation", name, f"{status} {content[:200]!r}")


# ---- the fleet and its faults --------------------------------------------------------------------

class Fleet:
    """`kimi-pd up` in its own session; children found by the pids it prints."""

    def __init__(self, workdir: Path, model_dir: Path, port: int) -> None:
        self.workdir, self.out = workdir, workdir / "up.out"
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": ADMIN}
        with open(self.out, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kimi_pd", "up", "--model", str(model_dir), "--port", str(port),
                 "--decode-workers", "2", "--log-dir", str(workdir / "logs")],
                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "kimi-pd is up" not in self.out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kimi-pd up did not start:\n{self.out.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)

    def pid(self, child: str) -> int | None:
        found = re.findall(rf"(?:started|restarted) {re.escape(child)} \(pid (\d+)", self.out.read_text())
        return int(found[-1]) if found else None

    def store_pid(self) -> int | None:
        """The embedded Valkey: `up`'s own child (not one of the supervised roles)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(rest[1]) == self.proc.pid and "valkey" in comm:
                return int(entry.name)
        return None

    def workers(self) -> dict[str, dict[str, Any]]:
        listed = httpx.get(self.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
        listed.raise_for_status()
        return {w["worker_id"]: w for w in listed.json()["workers"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


FAULTS = ("kill-decode", "stop-decode", "kill-prefill", "kill-router", "kill-store")


def inject(fleet: Fleet, fault: str, rng: random.Random, stop_s: float) -> dict[str, Any]:
    """One fault; returns what was done (for the report)."""
    target = {"kill-decode": rng.choice(["decode-0", "decode-1"]), "stop-decode": rng.choice(["decode-0", "decode-1"]),
              "kill-prefill": "prefill-0", "kill-router": "router", "kill-store": "store"}[fault]
    pid = fleet.store_pid() if target == "store" else fleet.pid(target)
    record: dict[str, Any] = {"fault": fault, "target": target, "at": round(time.monotonic(), 1), "pid": pid}
    if pid is None:
        record["skipped"] = "no pid"
        return record
    try:
        if fault == "stop-decode":
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(stop_s, _resume, (pid,)).start()
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        record["skipped"] = "already gone"
    return record


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


# ---- the run -------------------------------------------------------------------------------------

def _client_loop(traffic: Traffic, rng: random.Random, until: float, outcomes: list[Outcome]) -> None:
    names = sorted(traffic.specs)
    while time.monotonic() < until:
        name, roll = rng.choice(names), rng.random()
        outcomes.append(traffic.one(name, stream=roll < 0.6, cancel=roll < 0.1))


ClientLoop = Callable[[random.Random, float, list[Outcome]], None]   # (its rng, until, outcomes to append to)
Injector = Callable[[str, random.Random], dict[str, Any]]            # (fault kind, the schedule's rng) -> record


def drive_schedule(report: Report, seed: int, minutes: float, clients: int, fault_every_s: tuple[float, float],
                   faults: Sequence[str], client_loop: ClientLoop, inject_one: Injector) -> None:
    """The seeded schedule both chaos runs share: `clients` threads of traffic until the end while a fault
    of the next kind (every kind once in each round, in a seeded order) is injected every `fault_every_s`;
    then the outcomes and violations into `report`."""
    rng = random.Random(seed)
    until = time.monotonic() + minutes * 60
    outcomes: list[Outcome] = []
    threads = [threading.Thread(target=client_loop, args=(random.Random(seed * 100 + i), until, outcomes),
                                daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    kinds = itertools.cycle(rng.sample(list(faults), len(faults)))
    next_fault = time.monotonic() + rng.uniform(*fault_every_s)
    while time.monotonic() < until:
        if time.monotonic() >= next_fault:
            report.faults.append(inject_one(next(kinds), rng))
            next_fault = time.monotonic() + rng.uniform(*fault_every_s)
        time.sleep(0.2)
    for thread in threads:
        thread.join(IDLE_TIMEOUT_S + 30)
    report.outcomes.update(o.kind for o in outcomes)
    report.violations += [asdict(o) for o in outcomes if o.kind == "violation"]


def _drive(fleet: Fleet, traffic: Traffic, config: ChaosConfig, report: Report) -> None:
    drive_schedule(report, config.seed, config.minutes, config.clients, config.fault_every_s, FAULTS,
                   lambda rng, until, outcomes: _client_loop(traffic, rng, until, outcomes),
                   lambda kind, rng: inject(fleet, kind, rng, config.stop_s))


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _quiet(fleet: Fleet) -> dict[str, Any]:
    """The fleet's end state: its workers, and what each still holds."""
    workers = fleet.workers()
    held = {wid: {m: _metric(w["url"], "kimi_pd_worker_" + m) for m in ("held", "running", "waiting", "cache_usage")}
            for wid, w in workers.items()}
    return {"healthy": sorted(wid for wid, w in workers.items() if w["healthy"]), "held": held}


def poll_recovery(read_state: Callable[[], dict[str, Any]], recovered: Callable[[dict[str, Any]], bool],
                  timeout_s: float) -> dict[str, Any]:
    """Read the end state every second until `recovered` holds or `timeout_s` passed; the last state either
    way, with `recovered` set (a read that fails is a state too: `error`)."""
    deadline, state = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            state = read_state()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            state = {"error": repr(exc)}
        else:
            if recovered(state):
                return {**state, "recovered": True}
        time.sleep(1.0)
    return {**state, "recovered": False}


def recover(fleet: Fleet, timeout_s: float) -> dict[str, Any]:
    """Wait until the fleet is whole again and holds nothing; returns its last state either way."""
    def whole_and_quiet(state: dict[str, Any]) -> bool:
        return (state["healthy"] == ["decode-0", "decode-1", "prefill-0"]
                and all(not any(v.values()) for v in state["held"].values()))
    return poll_recovery(lambda: _quiet(fleet), whole_and_quiet, timeout_s)


def run(config: ChaosConfig, model_dir: Path, workdir: Path, port: int) -> Report:
    report = Report(config=asdict(config))
    fleet = Fleet(workdir, model_dir, port)
    try:
        fleet.wait_up()
        traffic = Traffic(fleet.url, request_specs())
        traffic.record_references()
        _drive(fleet, traffic, config, report)
        report.end_state = recover(fleet, config.recover_timeout_s)
    finally:
        fleet.stop()
        report.load_avg = os.getloadavg()
    return report


def chaos_parser(description: str, default_out: Path) -> argparse.ArgumentParser:
    """The command line both chaos runs take."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-every", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN_S", "MAX_S"))
    p.add_argument("--out", default=str(default_out))
    return p


def write_report(report: Report, out: str) -> int:
    """The report as JSON at `out`, its summary (all but the fault list) on stdout; the exit status: 0 when
    nothing was violated and the fleet recovered."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.to_json().items() if k != "faults"}, indent=2))
    return 0 if not report.violations and report.end_state.get("recovered") else 1


def main(argv: list[str] | None = None) -> int:
    args = chaos_parser(__doc__.split("\n\n")[0], RESULTS / "chaos.json").parse_args(argv)
    from engine.checkpoint.create import create_checkpoint
    from shared.net import free_port
    workdir = Path(tempfile.mkdtemp(prefix="kimi-pd-chaos-"))
    try:
        model = create_checkpoint("tiny", workdir / "tiny", seed=0, progress=False)
        config = ChaosConfig(minutes=args.minutes, seed=args.seed, fault_every_s=tuple(args.fault_every))
        report = run(config, model, workdir, free_port())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
