"""GiB/s of kv_transfer for a Kimi-K3-shaped hybrid state, per transport, against a plain socket.

Run: `python -m benchmarks.transfer [--tokens 8192] [--rounds 5] [--transports tcp torch-dist mooncake]`.
The state: 24 MLA layers x [tokens, 576] bf16, 69 KDA recurrent states [96, 128, 128] fp32 and 69
short-conv states [3, 3*96*128] bf16 (0.63 GiB at 8k tokens). Every sender runs in a child process
of its own, started together; the receiver is this process, over 127.0.0.1. A pull is timed from
the call to the verified whole state (fresh publish per pull). `tcp` MACs its frames as it sends
them, so its sender-side MAC is inside the pull's time; `torch-dist` and `mooncake` tag a state
once, when it is published (`kv_transfer.sideband`), so that pass is timed on its own, before the
pulls, and reported as `publish_tag_gib_s` (it runs while prefill finishes, not on the wire).

Baselines, measured in the same run: `plain-socket` is one loopback TCP socket moving the same
bytes into a pre-touched buffer, no framing, hashing or copies; `mooncake-raw` is Mooncake's own
TransferEngine (protocol tcp, P2PHANDSHAKE) reading the same tensors into pre-registered buffers,
no control plane and no digests. The machine is shared and noisy, so rounds are interleaved:
round r pulls once per transport (order rotated each round), round 0 is a warm-up. Ratios are of
medians over the timed rounds. Beside wall time each pull records the CPU seconds sender and
receiver spent on it (from /proc; Linux only), a figure less at the mercy of other tenants'
load than GiB/s: `cpu_s_per_gib`, the median, says what moving a GiB costs. Prints JSON and writes
benchmarks/results/transfer.json. A transport that cannot run here (e.g. mooncake not installed) is
reported with its error.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from kv_transfer.interface import (
    KVTransferParams,
    TransferConfig,
    make_receiver,
    make_sender,
)
from kv_transfer.payload import ModelIdentity, TransferPayload, byte_view
from kv_transfer.sideband import SidebandSender
from kv_transfer.wire import Gmac
from shared.net import free_port as _free_port

MLA_LAYERS, LATENT, KDA_LAYERS, HEADS, HEAD_DIM, CONV = 24, 576, 69, 96, 128, 3
IDENTITY = ModelIdentity("kimi-k3-bench", "bfloat16", "KKKM" * 23, 64)
SECRET = b"benchmark-secret-not-for-production"
RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
PLAIN, RAW = "plain-socket", "mooncake-raw"
GOALS = {"best_transport_vs_plain": 0.8, "every_transport_vs_plain": 0.6, "mooncake_vs_raw": 1.0}


def k3_state(tokens: int) -> TransferPayload:
    """A Kimi-K3-shaped export of random-looking bytes: a random block just over 8 MiB, tiled, so
    no two tensors (or chunks) are alike but six senders can build their states quickly on a
    loaded 2-core host (generating 0.63 GiB of random numbers each took minutes there)."""
    g = torch.Generator().manual_seed(0)
    size = (8 << 20) + 4099
    twice = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).repeat(2)
    offset = 0

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nonlocal offset
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), size):
            piece = flat[start:start + size]
            begin = offset % size
            piece.copy_(twice[begin:begin + piece.numel()])
            offset += piece.numel() + 12347
        return out

    tensors = {f"mla.{i}": rand((tokens, LATENT), torch.bfloat16) for i in range(MLA_LAYERS)}
    for i in range(KDA_LAYERS):
        tensors[f"kda_recurrent.{i}"] = rand((HEADS, HEAD_DIM, HEAD_DIM), torch.float32)
        tensors[f"kda_conv.{i}"] = rand((CONV, 3 * HEADS * HEAD_DIM), torch.bfloat16)
    return TransferPayload("bench", {"prompt_token_ids": list(range(tokens)), "first_token": 1}, tensors)


def state_digest(tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(byte_view(tensor.contiguous()))
    return h.hexdigest()


def make_config(transport: str, args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(identity=IDENTITY, secret=SECRET, transport=transport, streams=args.streams,
                          chunk_bytes=args.chunk_mib << 20, lease_s=600, transfer_timeout_s=300)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (all its threads), or None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def _init_group(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))


# -- senders (child processes) -----------------------------------------------------------------

async def _serve(transport: str, args: argparse.Namespace, conn) -> None:
    payload = k3_state(args.tokens)
    sender = make_sender(make_config(transport, args))
    await sender.start()
    try:
        params, tagging = [], []
        for i in range(args.rounds + 1):                  # + 1: the warm-up round
            copy = TransferPayload(f"bench-{i}", payload.meta, payload.tensors)
            start = time.perf_counter()
            params.append(sender.publish(copy, None, lambda rid, reason: None).to_dict())
            if isinstance(sender, SidebandSender):        # publish-time tags: timed on their own
                await sender.wait_tagged(copy.request_id)
                tagging.append(time.perf_counter() - start)
        conn.send((params, state_digest(payload.tensors.values()), tagging))
        await asyncio.to_thread(conn.recv)          # the parent's "done"
    finally:
        await sender.stop()


def _plain_socket_sender(args: argparse.Namespace, conn) -> None:
    views = [byte_view(t) for t in k3_state(args.tokens).tensors.values()]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        for _ in range(args.rounds + 1):
            peer, _ = listener.accept()
            with peer:
                for view in views:
                    peer.sendall(view)
        conn.recv()


def _mooncake_raw_sender(args: argparse.Namespace, conn) -> None:
    from kv_transfer.mooncake import shared_engine

    engine = shared_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    tensors = list(k3_state(args.tokens).tensors.values())
    addrs = [t.data_ptr() for t in tensors]
    sizes = [t.numel() * t.element_size() for t in tensors]
    if engine.batch_register_memory(addrs, sizes) != 0:
        raise RuntimeError("mooncake could not register the state")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", addrs, sizes, state_digest(tensors)))
    conn.recv()


def _child(transport: str, args: argparse.Namespace, conn, dist_port: int) -> None:
    try:
        if transport == PLAIN:
            _plain_socket_sender(args, conn)
        elif transport == RAW:
            _mooncake_raw_sender(args, conn)
        else:
            if transport == "torch-dist":
                _init_group(0, dist_port)
            asyncio.run(_serve(transport, args, conn))
    except BaseException:  # noqa: BLE001 - report to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))


# -- pullers (this process) --------------------------------------------------------------------

class PlainPuller:
    def __init__(self, port: int, nbytes: int) -> None:
        self.port = port
        self.view = byte_view(torch.ones(nbytes, dtype=torch.uint8))   # pre-touched: the ceiling

    async def pull(self, _round: int) -> float:
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            got = 0
            while got < len(self.view):
                n = sock.recv_into(self.view[got:])
                if n == 0:
                    raise ConnectionError("plain sender closed early")
                got += n
        return time.perf_counter() - start

    async def close(self) -> None:
        pass


class RawMooncakePuller:
    def __init__(self, first: tuple) -> None:
        from kv_transfer.mooncake import shared_engine

        self.session, self.remote, self.sizes, self.want = first
        self.engine = shared_engine("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        self.dst = [torch.ones(n, dtype=torch.uint8) for n in self.sizes]      # pre-touched
        self.local = [t.data_ptr() for t in self.dst]
        if self.engine.batch_register_memory(self.local, self.sizes) != 0:
            raise RuntimeError("mooncake could not register the receive buffers")

    async def pull(self, round_: int) -> float:
        start = time.perf_counter()
        rc = self.engine.batch_transfer_sync_read(self.session, self.local, self.remote, self.sizes)
        took = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"mooncake raw read failed (rc {rc})")
        if round_ == 1 and state_digest(self.dst) != self.want:
            raise AssertionError("mooncake-raw: received bytes differ from the sent ones")
        return took

    async def close(self) -> None:
        self.engine.batch_unregister_memory(self.local)


class TransportPuller:
    def __init__(self, transport: str, args: argparse.Namespace, first: tuple) -> None:
        self.transport = transport
        self.params = [KVTransferParams.from_dict(p) for p in first[0]]
        self.want = first[1]
        self.publish_tag_s = first[2]
        self.receiver = make_receiver(make_config(transport, args))
        self.started = False

    async def pull(self, round_: int) -> float:
        if not self.started:
            await self.receiver.start()
            self.started = True
        params = self.params[round_]
        start = time.perf_counter()
        payload = await self.receiver.pull(params)
        took = time.perf_counter() - start
        if round_ == 1 and state_digest(payload.tensors.values()) != self.want:
            raise AssertionError(f"{self.transport}: received state differs from the sent one")
        del payload
        await self.receiver.release(params)
        return took

    async def close(self) -> None:
        await self.receiver.stop()


class Row:
    """One transport of the run: its sender process, its puller, its times or its error."""

    def __init__(self, name: str, args: argparse.Namespace, ctx) -> None:
        self.name, self.args = name, args
        self.conn, child = ctx.Pipe()
        self.dist_port = _free_port()
        self.proc = ctx.Process(target=_child, args=(name, args, child, self.dist_port), daemon=True)
        self.puller = None
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.error: str | None = None

    def _cpu(self) -> float | None:
        """CPU seconds of this process and this row's sender so far."""
        mine, theirs = cpu_seconds(os.getpid()), cpu_seconds(self.proc.pid)
        return None if mine is None or theirs is None else mine + theirs

    def start(self) -> None:
        self.proc.start()

    def connect(self, nbytes: int) -> None:
        try:
            if self.name == "torch-dist":
                _init_group(1, self.dist_port)            # the child joins the same group
            if not self.conn.poll(180):
                raise TimeoutError(f"{self.name} sender did not start")
            first = self.conn.recv()
            if isinstance(first, tuple) and first[0] == "error":
                raise RuntimeError(first[1])
            self.puller = (PlainPuller(first, nbytes) if self.name == PLAIN else
                           RawMooncakePuller(first) if self.name == RAW else
                           TransportPuller(self.name, self.args, first))
        except Exception as exc:  # noqa: BLE001 - report and go on with the other transports
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.error = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        self.puller = None

    async def pull(self, round_: int) -> None:
        if self.puller is None:
            return
        try:
            before = self._cpu()
            took = await self.puller.pull(round_)
            after = self._cpu()
            if round_ > 0:
                self.times.append(took)
                if before is not None and after is not None:
                    self.cpu.append(after - before)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    async def close(self) -> None:
        if self.puller is not None:
            await self.puller.close()
        if self.proc.is_alive():
            self.conn.send("done")
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def result(self, nbytes: int) -> dict:
        if self.error is not None or not self.times:
            return {"error": self.error or "no timed pulls"}
        rates = sorted(nbytes / t / 2**30 for t in self.times)
        out = {"seconds": [round(t, 4) for t in self.times], "gib_s": round(statistics.median(rates), 3),
               "gib_s_min": round(rates[0], 3), "gib_s_max": round(rates[-1], 3)}
        if self.cpu:
            out["cpu_s_per_gib"] = round(statistics.median(self.cpu) / (nbytes / 2**30), 3)
        tagging = getattr(self.puller, "publish_tag_s", None)
        if tagging:        # sideband senders tag a state once, at publish, off the pull path
            out["publish_tag_gib_s"] = round(nbytes / statistics.median(tagging) / 2**30, 3)
        return out


async def run_rounds(rows: list[Row], rounds: int) -> None:
    for r in range(rounds + 1):
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            await row.pull(r)


def hash_speeds() -> dict[str, float]:
    """One core's GiB/s for SHA-256 (protocol 1's body hash) and GMAC (protocol 2's MAC), over
    memory in cache (a 256 KiB piece, as the tcp transport MACs it) and cold (256 MiB)."""
    cold = byte_view(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8))
    hot = cold[:256 << 10]
    mac = Gmac(bytes(32))
    out = {}
    for name, fn in (("sha256", lambda v: hashlib.sha256(v).digest()),
                     ("gmac", lambda v: mac.tag(bytes(12), v))):
        for temp, view, reps in (("hot", hot, 1024), ("cold", cold, 1)):
            start = time.perf_counter()
            for _ in range(reps):
                fn(view)
            out[f"{name}_{temp}_gib_s_one_core"] = round(len(view) * reps / 2**30 / (time.perf_counter() - start), 2)
    return out


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summarize(results: dict[str, dict]) -> dict:
    """Ratios of medians against the baselines, and whether each goal of issue 13 is met."""
    plain = results.get(PLAIN, {}).get("gib_s")
    raw = results.get(RAW, {}).get("gib_s")
    ratios = {name: round(r["gib_s"] / plain, 3) for name, r in results.items()
              if plain and name not in (PLAIN, RAW) and "gib_s" in r}
    out: dict = {"ratio_to_plain_socket": ratios}
    if raw and "gib_s" in results.get("mooncake", {}):
        out["mooncake_ratio_to_raw_engine"] = round(results["mooncake"]["gib_s"] / raw, 3)
    if plain and raw:
        out["mooncake_raw_ratio_to_plain_socket"] = round(raw / plain, 3)
    out["goals"] = {
        "best_transport_vs_plain >= 0.8": bool(ratios) and max(ratios.values()) >= 0.8,
        "every_transport_vs_plain >= 0.6": bool(ratios) and min(ratios.values()) >= 0.6,
        "mooncake >= raw engine": out.get("mooncake_ratio_to_raw_engine", 0) >= 1.0,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transports", nargs="+", default=["tcp", "torch-dist", "mooncake"])
    parser.add_argument("--streams", type=int, default=TransferConfig.streams)
    parser.add_argument("--chunk-mib", type=int, default=TransferConfig.chunk_bytes >> 20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_at_start = _load()
    nbytes = k3_state(args.tokens).nbytes()
    names = [PLAIN, *args.transports] + ([RAW] if "mooncake" in args.transports else [])
    ctx = mp.get_context("spawn")
    rows = [Row(name, args, ctx) for name in names]
    for row in rows:
        row.start()
    try:
        for row in rows:
            row.connect(nbytes)
        asyncio.run(_run_and_close(rows, args.rounds))
    finally:
        for row in rows:
            if row.proc.is_alive():
                row.proc.kill()
        _destroy_group()
    results = {row.name: row.result(nbytes) for row in rows}
    report = {"state": {"tokens": args.tokens, "bytes": nbytes, "gib": round(nbytes / 2**30, 3),
                        "mla_layers": MLA_LAYERS, "kda_layers": KDA_LAYERS},
              "config": {"streams": args.streams, "chunk_mib": args.chunk_mib, "rounds": args.rounds},
              "machine": {"cpus": os.cpu_count(), "load_average": {"start": load_at_start, "end": _load()},
                          "python": platform.python_version(), "torch": torch.__version__, **hash_speeds()},
              "results": results, **summarize(results)}
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


async def _run_and_close(rows: list[Row], rounds: int) -> None:
    try:
        await run_rounds(rows, rounds)
    finally:
        for row in rows:
            await row.close()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
