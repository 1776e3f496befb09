"""GiB/s of Mooncake's own tcp engine under its tunables, against a plain socket of the same run.

Run: `python -m benchmarks.mooncake_settings [--rounds 5] [--tokens 8192]
[--settings '{"name": {"MC_TCP_SLICE_SIZE": "1048576", ...}}']`.

Why: the `mooncake` transport can be no faster than the engine under it, so before tuning our
reads we ask whether an engine setting moves more bytes. The engine reads its settings once per
process (`MC_TCP_SLICE_SIZE`: bytes per socket write/read, default 64 KiB;
`MC_TCP_LANES_PER_PEER`: connections per peer, default 4), so every setting gets a sender and a
receiver process of its own, both started with that environment. Each pull reads the K3-shaped
state of `benchmarks.transfer` into pre-touched, pre-registered buffers, no control plane and no
tags, either with the engine's blocking `batch_transfer_sync_read` (which spins a core on the
batch status) or, for names with `"_poll": "1"`, one async read per tensor polled every 0.5 ms
(what the transport does). Rounds are interleaved and rotated; medians; CPU seconds per GiB of
sender and receiver from /proc. Prints and writes benchmarks/results/mooncake_settings.json.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from benchmarks.transfer import cpu_seconds, k3_state
from kv_transfer.payload import byte_view

RESULTS = Path(__file__).resolve().parent / "results" / "mooncake_settings.json"
PLAIN = "plain-socket"
DEFAULT_SETTINGS = {
    PLAIN: {},
    "sync-defaults": {},
    "sync-slice-1MiB": {"MC_TCP_SLICE_SIZE": str(1 << 20)},
    "polled-defaults": {"_poll": "1"},
    "polled-slice-1MiB": {"_poll": "1", "MC_TCP_SLICE_SIZE": str(1 << 20)},
    "polled-lanes-1": {"_poll": "1", "MC_TCP_LANES_PER_PEER": "1"},
    "polled-lanes-2": {"_poll": "1", "MC_TCP_LANES_PER_PEER": "2"},
}
POLL_S = 0.0005


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake engine failed to initialize")
    return engine


def _sender(name: str, env: dict, conn, tokens: int) -> None:
    os.environ.update({k: v for k, v in env.items() if not k.startswith("_")})
    torch.set_num_threads(1)
    tensors = list(k3_state(tokens).tensors.values())
    if name == PLAIN:
        views = [byte_view(t) for t in tensors]
        with socket.create_server(("127.0.0.1", 0)) as listener:
            conn.send(listener.getsockname()[1])
            while conn.recv() == "serve":
                peer, _ = listener.accept()
                with peer:
                    for view in views:
                        peer.sendall(view)
        return
    engine = _engine()
    addrs = [t.data_ptr() for t in tensors]
    sizes = [t.numel() * t.element_size() for t in tensors]
    if engine.batch_register_memory(addrs, sizes) != 0:
        raise RuntimeError("mooncake could not register the state")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", addrs, sizes))
    while conn.recv() == "serve":
        pass


def _plain_pull(port: int, view: memoryview) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("plain sender closed early")
            got += n


def _polled_read(engine, session: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
    pending = [engine.batch_transfer_async_read(session, [a], [b], [n])
               for a, b, n in zip(local, remote, sizes, strict=True)]
    rc = 0
    while pending:
        still = []
        for batch in pending:
            status = engine.transfer_check_status(batch)
            if status == 0:
                still.append(batch)
            elif status != 1:
                rc = status
        pending = still
        if pending:
            time.sleep(POLL_S)
    return rc


def _receiver(name: str, env: dict, conn, first) -> None:
    os.environ.update({k: v for k, v in env.items() if not k.startswith("_")})
    if name == PLAIN:
        port, nbytes = first
        view = byte_view(torch.ones(nbytes, dtype=torch.uint8))
        conn.send("ready")
        while conn.recv() == "pull":
            start = time.perf_counter()
            _plain_pull(port, view)
            conn.send(time.perf_counter() - start)
        return
    session, remote, sizes = first
    engine = _engine()
    dst = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    local = [t.data_ptr() for t in dst]
    if engine.batch_register_memory(local, sizes) != 0:
        raise RuntimeError("mooncake could not register the receive buffers")
    conn.send("ready")
    while conn.recv() == "pull":
        start = time.perf_counter()
        if env.get("_poll"):
            rc = _polled_read(engine, session, local, remote, sizes)
        else:
            rc = engine.batch_transfer_sync_read(session, local, remote, sizes)
        conn.send(time.perf_counter() - start if rc == 0 else float("nan"))


class Pair:
    """One setting: its sender and receiver processes, and what its pulls took."""

    def __init__(self, ctx, name: str, env: dict, tokens: int, nbytes: int) -> None:
        self.name, self.env, self.nbytes = name, env, nbytes
        self.conn, child = ctx.Pipe()
        self.sender = ctx.Process(target=_sender, args=(name, env, child, tokens), daemon=True)
        self.sender.start()
        self.ctx, self.receiver, self.pulls = ctx, None, None
        self.times: list[float] = []
        self.cpu: list[tuple[float, float]] = []

    def connect(self) -> None:
        first = self.conn.recv()
        if self.name == PLAIN:
            first = (first, self.nbytes)
        self.pulls, child = self.ctx.Pipe()
        self.receiver = self.ctx.Process(target=_receiver, args=(self.name, self.env, child, first),
                                         daemon=True)
        self.receiver.start()
        if self.pulls.recv() != "ready":
            raise RuntimeError(f"{self.name}: receiver did not start")

    def pull(self, timed: bool) -> None:
        before = (cpu_seconds(self.sender.pid) or 0.0, cpu_seconds(self.receiver.pid) or 0.0)
        if self.name == PLAIN:
            self.conn.send("serve")
        self.pulls.send("pull")
        took = self.pulls.recv()
        after = (cpu_seconds(self.sender.pid) or 0.0, cpu_seconds(self.receiver.pid) or 0.0)
        if timed:
            self.times.append(took)
            self.cpu.append((after[0] - before[0], after[1] - before[1]))

    def stop(self) -> None:
        for proc in (self.sender, self.receiver):
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join()

    def result(self) -> dict:
        gib = self.nbytes / 2**30
        ok = [t for t in self.times if not math.isnan(t)]
        if not ok:
            return {"error": "every pull failed"}
        return {"gib_s": round(statistics.median(gib / t for t in ok), 3), "failed_pulls": len(self.times) - len(ok),
                "cpu_s_per_gib_sender": round(statistics.median(c[0] for c in self.cpu) / gib, 3),
                "cpu_s_per_gib_receiver": round(statistics.median(c[1] for c in self.cpu) / gib, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settings", type=json.loads, default=DEFAULT_SETTINGS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    settings = {PLAIN: {}, **args.settings}
    load_at_start = os.getloadavg()
    nbytes = k3_state(args.tokens).nbytes()
    ctx = mp.get_context("spawn")
    pairs = [Pair(ctx, name, env, args.tokens, nbytes) for name, env in settings.items()]
    try:
        for pair in pairs:
            pair.connect()
        for r in range(args.rounds + 1):                   # round 0 warms up
            shift = r % len(pairs)
            for pair in pairs[shift:] + pairs[:shift]:
                pair.pull(timed=r > 0)
    finally:
        for pair in pairs:
            pair.stop()
    results = {pair.name: pair.result() for pair in pairs}
    plain = results[PLAIN]["gib_s"]
    report = {"state_gib": round(nbytes / 2**30, 3), "rounds": args.rounds, "settings": settings,
              "load_average": {"start": [round(x, 2) for x in load_at_start],
                               "end": [round(x, 2) for x in os.getloadavg()]},
              "results": results,
              "ratio_to_plain_socket": {name: round(r["gib_s"] / plain, 3)
                                        for name, r in results.items() if "gib_s" in r and name != PLAIN}}
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
