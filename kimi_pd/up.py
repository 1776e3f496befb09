"""`kimi-pd up`: the whole system on one machine, on embedded defaults.

Starts (unless given) an embedded Valkey store on loopback, then N prefill workers, M decode workers
and the router as child processes sharing generated secrets, waits until the router is ready, prints
the URL and a curl line, then supervises: a child that dies is restarted with backoff (and logged)
while the rest keep serving, and an embedded store that dies is restarted (empty; workers register
again with their next heartbeat). Ctrl-C / SIGTERM stops everything it started.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from kimi_pd.planner.pools import AutoscaleSettings, LocalAutoscaler, PoolScaler
from kimi_pd.processes import Processes, Supervisor
from shared.net import free_port
from shared.redact import redact_url
from shared.store.embedded import EmbeddedValkey, EmbeddedValkeyError
from shared.store.factory import REDIS_URL_ENV

READY_TIMEOUT_S = 180.0
KIMI_PD = [sys.executable, "-m", "kimi_pd"]
# the workers' engine flags `up` takes and passes on to every worker, as `vllm serve` takes them
ENGINE_FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--scheduling-policy",
                "--enable-prefix-caching", "--block-size", "--dtype", "--device", "--cache-memory",
                "--kda-chunk-size", "--tensor-parallel-size", "--enable-expert-parallel", "--compilation-config",
                "--enforce-eager", "--max-structured-output-bytes", "--kv-transport", "--kv-streams",
                "--request-share")
# the router's admission flags (docs/admission.md), passed on to the router
ROUTER_FLAGS = ("--tenants", "--max-inflight-per-worker", "--max-queued", "--queue-timeout",
                "--max-sequences-per-request")
_PREFIX = "passed_"


def add_passed_args(p: argparse.ArgumentParser) -> None:
    """`up` takes the workers' engine flags and the router's admission flags with the children's own
    parsing, help and choices (a bad value is refused before anything starts); absent ones stay unset,
    so each child keeps its own default."""
    from router.cli import add_router_args
    from worker.flags import add_worker_args
    for title, add, names in (("engine (every worker)", add_worker_args, ENGINE_FLAGS),
                              ("admission (the router)", add_router_args, ROUTER_FLAGS)):
        source, group = argparse.ArgumentParser(add_help=False), p.add_argument_group(title)
        add(source)
        for action in source._actions:
            if action.option_strings and action.option_strings[0] in names:
                flags = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
                if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
                    group.add_argument(*flags, action=type(action), dest=_PREFIX + action.dest,
                                       default=argparse.SUPPRESS, help=action.help)
                    continue
                added = group.add_argument(*flags, choices=action.choices, help=action.help,
                                           metavar=action.metavar or (None if action.choices else action.dest.upper()),
                                           dest=_PREFIX + action.dest, default=argparse.SUPPRESS)
                added.type = action.type                 # the child's own parsing (sizes, numbers)


def passed_argv(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The command-line flags among `names` the user gave to `up`, as the child parses them."""
    out: list[str] = []
    for flag in names:
        dest = _PREFIX + flag.lstrip("-").replace("-", "_")
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if isinstance(value, bool):
            if value or flag == "--enable-prefix-caching":
                out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


class PortTaken(ValueError):
    """The router's port already has a listener: another `kimi-pd up` (perhaps orphaned) or anything else."""


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Refuse to start when `port` is taken: the readiness check would otherwise be answered by whatever
    listens there, and our own router would crash-loop on "address already in use".

    SO_REUSEADDR, as the router's server sets it, so a port left in TIME_WAIT by a stopped fleet is free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortTaken(f"port {port} on {host} is already in use ({exc.strerror}); stop what listens "
                            f"there (`ss -ltnp 'sport = :{port}'` shows it) or choose another --port") from exc


def wait_ready(url: str, fleet: Processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fleet.dead():
            raise RuntimeError(f"a process exited during start-up: {', '.join(fleet.dead())}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the router at {url} was not ready within {timeout_s:.0f} s")


def start_pools(supervisor: Supervisor, common: list[str], env: dict[str, str], log_dir: Path, num_prefill: int,
                num_decode: int, autoscale: AutoscaleSettings | None, redis_url: str) -> LocalAutoscaler | None:
    """The prefill and decode workers, named `<role>-<i>`; with `autoscale`, what grows and shrinks them."""
    def spawn_worker(role: str, name: str) -> None:
        supervisor.spawn(name, [*KIMI_PD, role, *common, "--port", str(free_port()), "--worker-id", name],
                         env, log_dir / f"{name}.log")

    scaler = PoolScaler(spawn_worker, supervisor.retire)
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for _ in range(count):
            scaler.start(role)
    if autoscale is None:
        return None
    return LocalAutoscaler(autoscale, redis_url, scaler, lambda line: print(line, file=sys.stderr, flush=True))


def restart_store(store: EmbeddedValkey) -> None:
    print("kimi-pd: the embedded store exited; restarting it (empty, workers register again)",
          file=sys.stderr, flush=True)
    try:
        store.restart()
    except EmbeddedValkeyError as exc:             # e.g. its port still taken: next round
        print(f"kimi-pd: store restart failed, retrying: {exc}", file=sys.stderr, flush=True)


def up(model_dir: str, port: int, num_prefill: int, num_decode: int, redis_url: str | None, log_dir: Path,
       extra_worker_args: list[str], speculative_args: list[str] | None = None,
       autoscale: AutoscaleSettings | None = None, router_args: list[str] | None = None) -> int:
    """speculative_args (`--speculative-config JSON`) go to every worker: decode workers speculate; prefill
    workers run the draft's context projection so the prompt's draft rows travel with the state.
    router_args: more router flags (the request-surface flags, which the workers get too).
    autoscale: the pools start at the given counts, then follow the load within its bounds."""
    check_port_free(port)
    fleet, store, autoscaler = Processes(), None, None
    supervisor = Supervisor(fleet, report=lambda line: print(line, file=sys.stderr, flush=True))
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        if redis_url is None:
            store = EmbeddedValkey(password=secrets.token_hex(24))   # nobody else on the host can register
            store.start()
            redis_url = store.url
        env = {**os.environ,
               "KIMI_PD_TRANSFER_SECRET": os.environ.get("KIMI_PD_TRANSFER_SECRET") or secrets.token_hex(24),
               "KIMI_PD_ADMIN_TOKEN": os.environ.get("KIMI_PD_ADMIN_TOKEN") or secrets.token_hex(16),
               REDIS_URL_ENV: redis_url}                   # through the environment: no password in `ps`
        common = ["--model", model_dir, *extra_worker_args, *(speculative_args or [])]
        autoscaler = start_pools(supervisor, common, env, log_dir, num_prefill, num_decode, autoscale, redis_url)
        supervisor.spawn("router", [*KIMI_PD, "router", "--model", model_dir, "--port", str(port),
                                    *(router_args or [])], env, log_dir / "router.log")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, fleet, READY_TIMEOUT_S)
        print(f"kimi-pd is up: {url}  ({num_prefill} prefill + {num_decode} decode workers, "
              f"store {redact_url(redis_url)})")
        print(f"logs: {log_dir}/   stop: Ctrl-C")
        print(f"""curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' """
              """-d '{"model": "kimi-k3", "messages": [{"role": "user", "content": "What is 347 + 586?"}]}'""",
              flush=True)
        while not stopping["flag"]:
            supervisor.poll()
            if autoscaler is not None:
                autoscaler.tick(time.monotonic())
            if store is not None and not store.running:
                restart_store(store)
            time.sleep(0.2)
        return 0
    finally:
        fleet.stop()
        if autoscaler is not None:
            autoscaler.close()
        if store is not None:
            store.stop()
