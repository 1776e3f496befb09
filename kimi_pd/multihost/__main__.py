"""`python -m kimi_pd.multihost`: rehearse the fleet across hosts on this machine (root needed).

Builds the namespace hosts, starts every role with its deploy/compose/roles command, sends a few
requests through the load balancer, checks with `ss` that no role reached another over 127.0.0.1,
prints where each role listens and what crossed the bridge, and tears everything down (or, with
--hold, keeps it up until Ctrl-C so you can `ip netns exec` into a host and look around).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kimi_pd.multihost.fleet import ConnectionSampler, FleetSpec, MultiHostFleet
from kimi_pd.multihost.netns import unavailable_reason

PROMPT = " ".join(["the lighthouse keeper counted the boats along the shore"] * 6)


def _model(path: str | None, workdir: Path) -> Path:
    if path:
        return Path(path)
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", workdir / "model", seed=0, progress=False)


def _traffic(fleet: MultiHostFleet, requests: int) -> list[str]:
    lines = []
    with fleet.client() as http:
        for i in range(requests):
            t0 = time.perf_counter()
            resp = http.post(fleet.url("lb") + "/v1/completions", json={
                "model": "kimi-k3", "prompt": f"{i} {PROMPT}", "max_tokens": 8, "temperature": 0})
            resp.raise_for_status()
            h = resp.headers
            lines.append(f"  request {i}: {h['x-kimi-pd-decision']} P={h.get('x-kimi-pd-prefill-worker', '-')} "
                         f"D={h.get('x-kimi-pd-decode-worker', '-')} {1000 * (time.perf_counter() - t0):.0f} ms")
    return lines


def rehearse(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kimi-pd-multihost-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    spec = FleetSpec(_model(args.model, workdir), workdir, prefill=args.prefill, decode=args.decode)
    t0 = time.monotonic()
    with MultiHostFleet(spec) as fleet:
        print(f"fleet up in {time.monotonic() - t0:.1f} s (logs: {workdir})")
        for name, host in fleet.net.hosts.items():
            print(f"  {name:10s} {host.addr:12s} netns {host.ns}")
        with ConnectionSampler(fleet) as sampler:
            print("\n".join(_traffic(fleet, args.requests)))
        loopback = [c for c in sampler.seen if c.loopback]
        print("crossed the bridge (client host -> server host:port):")
        for src, dst, port in sorted(fleet.edges(sampler.seen)):
            print(f"  {src} -> {dst}:{port}")
        if loopback:
            print(f"FAIL: connections over 127.0.0.1: {loopback}")
            return 1
        print(f"no role reached another over 127.0.0.1; LB at {fleet.url('lb')} (from the client host)")
        if args.hold:
            print("holding; Ctrl-C tears it down")
            try:
                while not fleet.procs.dead():
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    print(f"torn down; {time.monotonic() - t0:.1f} s in all")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_pd.multihost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: a tiny generated one)")
    p.add_argument("--workdir", help="logs and configs (default: a new temporary directory)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--hold", action="store_true", help="keep the fleet up until Ctrl-C")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"cannot rehearse here: {reason}", file=sys.stderr)
        return 2
    return rehearse(args)


if __name__ == "__main__":
    raise SystemExit(main())
