"""`kimi-pd autoscale-signal`: reads the fleet's load from the state store every `--interval-s` and
serves the damped desired pool sizes on GET /metrics (Prometheus text) for an HPA or KEDA."""
from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kimi_pd.planner.signal import POOLS, Bounds, Damper, Targets, pool_loads, raw_desired, render_metrics
from shared.store.base import StateStore
from shared.store.factory import REDIS_URL_ENV, make_store


class Signal:
    """The latest decision per pool, recomputed from one read of the store."""

    def __init__(self, store: StateStore, bounds: dict[str, Bounds], targets: Targets, down_window_s: float,
                 down_step_s: float) -> None:
        self.store, self.targets = store, targets
        self.dampers = {p: Damper(bounds[p], down_window_s, down_step_s) for p in POOLS}
        self.text = "# no reading yet\n"

    async def refresh(self, now: float) -> dict[str, int]:
        loads = pool_loads(await self.store.workers())
        desired = {p: self.dampers[p].decide(now, raw_desired(p, loads[p], self.targets)) for p in POOLS}
        self.text = render_metrics(desired, loads)
        return desired


def add_signal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help=f"the fleet's store (default: ${REDIS_URL_ENV})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9400)
    p.add_argument("--interval-s", type=float, default=5.0)
    p.add_argument("--prefill-bounds", default="1:16", help="MIN:MAX prefill workers")
    p.add_argument("--decode-bounds", default="1:16", help="MIN:MAX decode workers")
    p.add_argument("--prefill-busy-per-worker", type=float, default=Targets.prefill_busy_per_worker)
    p.add_argument("--decode-fill", type=float, default=Targets.decode_fill)
    p.add_argument("--decode-batch", type=int, default=Targets.decode_batch, help="the workers' --max-num-seqs")
    p.add_argument("--down-window-s", type=float, default=60.0, help="scale in only below the window's peak")
    p.add_argument("--down-step-s", type=float, default=30.0, help="at most one worker removed per this")


def parse_bounds(text: str) -> Bounds:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(f"bounds are MIN:MAX, got {text!r}")
    return Bounds(int(lo), int(hi))


def run_signal(args: argparse.Namespace) -> int:
    store = make_store(args.redis_url or os.environ.get(REDIS_URL_ENV))
    targets = Targets(args.prefill_busy_per_worker, args.decode_fill, args.decode_batch)
    signal = Signal(store, {"prefill": parse_bounds(args.prefill_bounds), "decode": parse_bounds(args.decode_bounds)},
                    targets, args.down_window_s, args.down_step_s)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = signal.text.encode() if self.path == "/metrics" else b"not found\n"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"autoscale signal: http://{args.host}:{server.server_port}/metrics", flush=True)

    async def loop() -> None:
        while True:
            await signal.refresh(time.monotonic())
            await asyncio.sleep(args.interval_s)

    try:
        asyncio.run(loop())
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0
