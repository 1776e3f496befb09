"""GiB/s of kv_transfer for a Kimi-K3-shaped hybrid state, per transport, against a plain socket.

Run: `python -m benchmarks.transfer [--tokens 8192] [--repeats 3] [--transports tcp torch-dist mooncake]`.
The state: 24 MLA layers x [tokens, 576] bf16, 69 KDA recurrent states [96, 128, 128] fp32 and 69
short-conv states [3, 3*96*128] bf16 (0.63 GiB at 8k tokens). Each transport's sender runs in a
child process and the receiver here, over 127.0.0.1; a pull is timed from the call to the verified
whole state. The ceiling is one plain loopback TCP socket moving the same bytes, also from a child
process, with no framing, hashing or copies. Prints JSON and writes benchmarks/results/transfer.json.
A transport that cannot run here (e.g. mooncake not installed) is reported with its error.
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

from kv_transfer.interface import KVTransferParams, TransferConfig, make_receiver, make_sender
from kv_transfer.payload import ModelIdentity, TransferPayload, byte_view

MLA_LAYERS, LATENT, KDA_LAYERS, HEADS, HEAD_DIM, CONV = 24, 576, 69, 96, 128, 3
IDENTITY = ModelIdentity("kimi-k3-bench", "bfloat16", "KKKM" * 23, 64)
SECRET = b"benchmark-secret-not-for-production"
RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"


def k3_state(tokens: int) -> TransferPayload:
    """A Kimi-K3-shaped export filled with random bits."""
    g = torch.Generator().manual_seed(0)

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g).view(dtype) \
            if dtype.itemsize == 2 else torch.randn(shape, generator=g, dtype=dtype)

    tensors = {f"mla.{i}": rand((tokens, LATENT), torch.bfloat16) for i in range(MLA_LAYERS)}
    for i in range(KDA_LAYERS):
        tensors[f"kda_recurrent.{i}"] = rand((HEADS, HEAD_DIM, HEAD_DIM), torch.float32)
        tensors[f"kda_conv.{i}"] = rand((CONV, 3 * HEADS * HEAD_DIM), torch.bfloat16)
    return TransferPayload("bench", {"prompt_token_ids": list(range(tokens)), "first_token": 1}, tensors)


def state_digest(payload: TransferPayload) -> str:
    h = hashlib.sha256()
    for tensor in payload.tensors.values():
        h.update(byte_view(tensor.contiguous()))
    return h.hexdigest()


def make_config(transport: str, args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(identity=IDENTITY, secret=SECRET, transport=transport, streams=args.streams,
                          chunk_bytes=args.chunk_mib << 20, lease_s=600, transfer_timeout_s=300)


def _init_group(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))


async def _serve(transport: str, args: argparse.Namespace, conn) -> None:
    payload = k3_state(args.tokens)
    sender = make_sender(make_config(transport, args))
    await sender.start()
    try:
        params = []
        for i in range(args.repeats + 1):                 # + 1: an untimed warm-up pull
            copy = TransferPayload(f"bench-{i}", payload.meta, payload.tensors)
            params.append(sender.publish(copy, None, lambda rid, reason: None).to_dict())
        conn.send((params, state_digest(payload)))
        await asyncio.to_thread(conn.recv)          # the parent's "done"
    finally:
        await sender.stop()


def _plain_socket_sender(args: argparse.Namespace, conn) -> None:
    views = [byte_view(t) for t in k3_state(args.tokens).tensors.values()]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        for _ in range(args.repeats + 1):
            peer, _ = listener.accept()
            with peer:
                for view in views:
                    peer.sendall(view)


def _child(transport: str, args: argparse.Namespace, conn, dist_port: int) -> None:
    try:
        if transport == "plain-socket":
            _plain_socket_sender(args, conn)
            return
        if transport == "torch-dist":
            _init_group(0, dist_port)
        asyncio.run(_serve(transport, args, conn))
    except BaseException:  # noqa: BLE001 - report to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))


def _plain_socket_pull(port: int, view: memoryview) -> float:
    nbytes = len(view)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("plain sender closed early")
            got += n
    return time.perf_counter() - start


async def _pull_all(transport: str, args: argparse.Namespace, params: list[dict], want: str) -> list[float]:
    receiver = make_receiver(make_config(transport, args))
    await receiver.start()
    times = []
    try:
        for i, raw in enumerate(params):
            p = KVTransferParams.from_dict(raw)
            start = time.perf_counter()
            payload = await receiver.pull(p)
            times.append(time.perf_counter() - start)
            if i == 1 and state_digest(payload) != want:
                raise AssertionError(f"{transport}: received state differs from the sent one")
            del payload
            await receiver.release(p)
    finally:
        await receiver.stop()
    return times


def run_transport(transport: str, args: argparse.Namespace, nbytes: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dist_port = _free_port()
    proc = ctx.Process(target=_child, args=(transport, args, child, dist_port), daemon=True)
    proc.start()
    try:
        if transport == "torch-dist":
            _init_group(1, dist_port)                     # the child joins the same group first
        if not parent.poll(120):
            raise TimeoutError(f"{transport} sender did not start")
        first = parent.recv()
        if isinstance(first, tuple) and first[0] == "error":
            raise RuntimeError(first[1])
        if transport == "plain-socket":
            view = byte_view(torch.zeros(nbytes, dtype=torch.uint8))  # pre-touched: the ceiling
            times = [_plain_socket_pull(first, view) for _ in range(args.repeats + 1)]
        else:
            times = asyncio.run(_pull_all(transport, args, *first))
            parent.send("done")
        times = times[1:]                                  # drop the warm-up
        return {"seconds": [round(t, 4) for t in times],
                "gib_s": round(nbytes / statistics.median(times) / 2**30, 3)}
    finally:
        _cleanup(proc, transport)


def _cleanup(proc, transport: str) -> None:
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if transport == "torch-dist":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def sha256_gib_s() -> float:
    """One core's SHA-256 speed: every transport hashes each byte once on each side."""
    block = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8)
    start = time.perf_counter()
    hashlib.sha256(byte_view(block)).digest()
    return round(0.25 / (time.perf_counter() - start), 3)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["tcp", "torch-dist", "mooncake"])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = k3_state(args.tokens)
    nbytes = state.nbytes()
    del state
    ceiling = run_transport("plain-socket", args, nbytes)
    report = {"state": {"tokens": args.tokens, "bytes": nbytes, "gib": round(nbytes / 2**30, 3),
                        "mla_layers": MLA_LAYERS, "kda_layers": KDA_LAYERS},
              "config": {"streams": args.streams, "chunk_mib": args.chunk_mib, "repeats": args.repeats},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "sha256_gib_s_one_core": sha256_gib_s()},
              "ceiling_plain_socket": ceiling, "transports": {}}
    for transport in args.transports:
        try:
            result = run_transport(transport, args, nbytes)
            result["ratio_to_ceiling"] = round(result["gib_s"] / ceiling["gib_s"], 3)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next transport
            result = {"error": f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[-1]}"}
        report["transports"][transport] = result
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
