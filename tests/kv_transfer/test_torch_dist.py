"""torch-dist transport: two spawned processes in one gloo group over 127.0.0.1, rank 0 sending,
rank 1 pulling two states concurrently. Each process is bounded in time and killed on failure."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta

import pytest

from tests.kv_transfer.helpers import (
    FreeLog,
    assert_same,
    config,
    eventually,
    hybrid_payload,
    metrics,
    serving,
)

pytestmark = pytest.mark.timeout(60)
REQUESTS = (("dist-a", 2048, 1), ("dist-b", 512, 2))


async def _send(params_q: mp.Queue) -> str:
    from kv_transfer.interface import make_sender

    log = FreeLog()
    async with serving(make_sender(config(transport="torch-dist"), metrics())) as sender:
        for rid, tokens, seed in REQUESTS:
            params_q.put(sender.publish(hybrid_payload(rid, tokens, seed), None, log).to_dict())
        await eventually(lambda: sender.held_count() == 0, timeout_s=30)
    assert sorted(log.calls) == [("dist-a", "released"), ("dist-b", "released")], log.calls
    return "released"


async def _receive(params_q: mp.Queue) -> str:
    from kv_transfer.interface import KVTransferParams, make_receiver

    raw = [await asyncio.to_thread(params_q.get, True, 30) for _ in REQUESTS]
    params = [KVTransferParams.from_dict(p) for p in raw]
    receiver = make_receiver(config(transport="torch-dist"), metrics())
    await receiver.start()
    got = await asyncio.gather(*(receiver.pull(p) for p in params))
    for (rid, tokens, seed), payload in zip(REQUESTS, got, strict=True):
        assert_same(hybrid_payload(rid, tokens, seed), payload)
    assert all([await receiver.release(p) for p in params])
    return "pulled"


def _rank_main(rank: int, port: int, params_q: mp.Queue, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=30))
        role = _send if rank == 0 else _receive
        results.put((rank, asyncio.run(asyncio.wait_for(role(params_q), 40))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_round_trip_between_two_ranks() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    params_q, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, params_q, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        outcome = dict(results.get(timeout=50) for _ in procs)
        assert outcome == {0: "released", 1: "pulled"}, outcome
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def test_verification_cannot_be_switched_off_on_gloo() -> None:
    """gloo moves bytes over plain TCP, so `verify_data=False` is refused when a receiver starts
    (a one-rank group in this process, torn down afterwards)."""
    import torch.distributed as dist

    from kv_transfer.errors import TransferConfigError
    from kv_transfer.interface import make_receiver
    from tests.kv_transfer.helpers import run

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    try:
        with pytest.raises(TransferConfigError, match="gloo"):
            run(make_receiver(config(transport="torch-dist", verify_data=False), metrics()).start())
        run(make_receiver(config(transport="torch-dist"), metrics()).start())      # default: fine
    finally:
        dist.destroy_process_group()
