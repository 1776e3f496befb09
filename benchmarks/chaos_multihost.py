"""Chaos run across hosts: the chaos run's traffic and invariants (benchmarks/chaos.py) on the multi-host
fleet (kimi_pd/multihost: network namespaces on a bridge; 2 prefill and 2 decode hosts, 2 routers behind
HAProxy, the store on its own host), while a seeded schedule unplugs one host's link for a while and plugs
it back: a decode host, a prefill host, the store host or a router host, every kind once in each round.

A link down is silence (no reset): streams on a decode host stall and resume (or migrate after the
routers' idle timeout), pulls from a prefill host time out and the decode worker recomputes, the routers
route on their last view of the store, and HAProxy takes a silent router out (closing its streams: the
client sees a broken connection, an explicit failure). Invariants, as in the chaos run: every 200 is the
reference answer (greedy and seeded), every failure is explicit, nothing hangs past the idle timeout; at
the end every worker is back in the routers' view, holding no state, running and waiting for nothing.
Needs root (`ip netns`).

    python -m benchmarks.chaos_multihost --minutes 10      # results/chaos_multihost.json
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos import (
    Outcome,
    Report,
    Traffic,
    chaos_parser,
    drive_schedule,
    poll_recovery,
    request_specs,
    write_report,
)
from kimi_pd.multihost.netns import inside

RESULTS = Path(__file__).resolve().parent / "results"
FAULTS = ("decode", "prefill", "store", "router")        # whose link goes down


@dataclass(frozen=True)
class MultiHostChaosConfig:
    minutes: float = 10.0
    seed: int = 0
    fault_every_s: tuple[float, float] = (20.0, 40.0)
    link_down_s: tuple[float, float] = (4.0, 10.0)
    clients: int = 3
    recover_timeout_s: float = 120.0


def inject(fleet, kind: str, rng: random.Random, down_s: float) -> dict[str, Any]:
    """Unplug one host of `kind` for `down_s` seconds, then plug it back (always)."""
    name = "store" if kind == "store" else rng.choice(fleet.role_hosts(kind))
    start = time.monotonic()
    fleet.net.set_link(name, up=False)
    try:
        time.sleep(down_s)
    finally:
        fleet.net.set_link(name, up=True)
    return {"fault": "link-down", "host": name, "seconds": round(time.monotonic() - start, 1), "at": time.time()}


def _client_loop(fleet, traffic: Traffic, rng: random.Random, until: float, outcomes: list[Outcome]) -> None:
    names = sorted(traffic.specs)
    with inside(fleet.host("client").ns):
        while time.monotonic() < until:
            name, roll = rng.choice(names), rng.random()
            outcomes.append(traffic.one(name, stream=roll < 0.6, cancel=roll < 0.1))


def drive(fleet, traffic: Traffic, config: MultiHostChaosConfig, report: Report) -> None:
    drive_schedule(report, config.seed, config.minutes, config.clients, config.fault_every_s, FAULTS,
                   lambda rng, until, outcomes: _client_loop(fleet, traffic, rng, until, outcomes),
                   lambda kind, rng: inject(fleet, kind, rng, rng.uniform(*config.link_down_s)))


def _metric(http: httpx.Client, url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def end_state(fleet) -> dict[str, Any]:
    """Each router's view of the fleet, and what each worker still holds, runs and waits for."""
    workers = [*fleet.role_hosts("prefill"), *fleet.role_hosts("decode")]
    with fleet.client() as http:
        views = {r: http.get(fleet.url(r) + "/ready", timeout=5).json()["workers"] for r in fleet.role_hosts("router")}
        held = {w: {m: _metric(http, fleet.url(w), "kimi_pd_worker_" + m) for m in ("held", "running", "waiting")}
                for w in workers}
        leases = {w: _metric(http, fleet.url(w), "kimi_pd_kv_held_leases") for w in fleet.role_hosts("prefill")}
    return {"router_views": views, "held": held, "held_leases": leases}


def recover(fleet, timeout_s: float) -> dict[str, Any]:
    """Wait until every router sees every worker again and nothing is held; the last state either way."""
    full = {"prefill": fleet.spec.prefill, "decode": fleet.spec.decode}

    def whole_and_quiet(state: dict[str, Any]) -> bool:
        whole = all({k: v.get(k) for k in full} == full for v in state["router_views"].values())
        return whole and all(not any(v.values()) for v in state["held"].values()) \
            and not any(state["held_leases"].values())
    return poll_recovery(lambda: end_state(fleet), whole_and_quiet, timeout_s)


def run(fleet, config: MultiHostChaosConfig) -> Report:
    """The chaos run on an open MultiHostFleet (its routers and LB ready)."""
    report = Report(config=asdict(config))
    traffic = Traffic(fleet.url("lb"), request_specs())
    with inside(fleet.host("client").ns):
        traffic.record_references()
    try:
        drive(fleet, traffic, config, report)
    finally:
        for name in fleet.net.hosts:
            fleet.net.set_link(name, up=True)
    report.end_state = recover(fleet, config.recover_timeout_s)
    report.load_avg = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> int:
    args = chaos_parser(__doc__.split("\n\n")[0], RESULTS / "chaos_multihost.json").parse_args(argv)
    from engine.checkpoint.create import create_checkpoint
    from kimi_pd.multihost.fleet import FleetSpec, MultiHostFleet
    workdir = Path(tempfile.mkdtemp(prefix="kimi-pd-mh-chaos-"))
    workdir.chmod(0o755)
    try:
        model = create_checkpoint("tiny", workdir / "tiny", seed=0, progress=False)
        config = MultiHostChaosConfig(minutes=args.minutes, seed=args.seed, fault_every_s=tuple(args.fault_every))
        with MultiHostFleet(FleetSpec(model, workdir / "fleet")) as fleet:
            report = run(fleet, config)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
