"""`torch-dist` transport: tensor bytes move by torch.distributed point-to-point send/recv between
ranks of one process group (`gloo` on CPU, `nccl` on CUDA, `hccl` on Ascend); the control plane
(handshake, leases, tags, end) is the shared TCP one (`kv_transfer.sideband`).

Data phase of one pull, after the manifest {rank, tag, nonce}:

    receiver: lock(source rank); send `ready`; irecv every tensor; wait for each in order and
              tag it while the later ones still arrive; unlock
    sender:   wait for `ready`; lock(destination rank); isend every tensor; wait; unlock

Because a receiver announces `ready` for one source rank at a time and the sender sends only
after `ready`, send/recv pairs match in order even on backends that ignore tags (nccl, hccl).

The caller owns the process group: it must be initialized (`torch.distributed.init_process_group`)
before `start()` in every process that sends or receives. Tensors are held and received on
`config.device`. Limitation (torch.distributed's): if a peer dies mid-transfer the pull fails
fast (`PeerClosed`, seen on the control connection), but the process group is then broken and
must be rebuilt before it carries another transfer.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import TypeGuard

import torch
import torch.distributed as dist

from kv_transfer.errors import CorruptFrame, TransferConfigError
from kv_transfer.payload import flat_bytes
from kv_transfer.server import HeldState
from kv_transfer.sideband import DataTagger, SidebandReceiver, SidebandSender
from kv_transfer.wire import Channel


def _require_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise TransferConfigError("torch-dist transport needs an initialized torch.distributed process group")


def _valid_peer(rank: object) -> TypeGuard[int]:
    return isinstance(rank, int) and 0 <= rank < dist.get_world_size() and rank != dist.get_rank()


def _exchange(tensors: list[torch.Tensor], peer: int, tag: int, send: bool, timeout_s: float,
              landed: Callable[[int], object] | None = None) -> None:
    """Post every non-empty tensor's bytes, in order, then wait for each, calling `landed(i)`
    as tensor i completes. Blocking (run in a thread)."""
    op = dist.isend if send else dist.irecv
    works = [(i, op(flat_bytes(t), peer, tag=tag)) for i, t in enumerate(tensors) if t.numel()]
    for i, work in works:
        if work is None:  # torch posts nothing for a rank outside the default group
            raise TransferConfigError(f"rank {dist.get_rank()} is not in the process group of peer {peer}")
        work.wait(timeout=timedelta(seconds=timeout_s))
        if landed is not None:
            landed(i)


class TorchDistSender(SidebandSender):
    """Sends held tensors to the pulling rank once it is ready."""

    transport_name = "torch-dist"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._peer_locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def start(self) -> None:
        _require_group()
        await super().start()

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.config.device).contiguous()

    async def _offer(self, state: HeldState, request: dict) -> dict:
        if not _valid_peer(request.get("rank")):
            raise CorruptFrame(f"bad torch-dist pull request (rank {request.get('rank')!r})")
        return {"rank": dist.get_rank(), "tag": 1 + secrets.randbelow(2**31 - 2)}

    async def _push(self, chan: Channel, state: HeldState, request: dict, offer: dict) -> None:
        await chan.recv_message("ready", timeout_s=self.config.transfer_timeout_s)
        async with self._peer_locks[request["rank"]]:
            await asyncio.to_thread(_exchange, state.tensors, request["rank"], offer["tag"], True,
                                    self.config.transfer_timeout_s)


class TorchDistReceiver(SidebandReceiver):
    """Receives a pulled state from the sender's rank into tensors on `config.device`."""

    transport_name = "torch-dist"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._peer_locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def start(self) -> None:
        _require_group()
        if not self.config.verify_data and dist.get_backend() == "gloo":
            raise TransferConfigError("verify_data=False is refused on gloo: its bytes cross plain TCP")

    def _pull_fields(self) -> dict:
        _require_group()
        return {"rank": dist.get_rank()}

    async def _move(self, chan: Channel, manifest: dict, tensors: list[torch.Tensor],
                    tagger: DataTagger | None) -> None:
        src, tag = manifest.get("rank"), manifest.get("tag")
        if not _valid_peer(src) or not isinstance(tag, int):
            raise CorruptFrame(f"manifest names an invalid source rank {src!r} or tag")
        async with self._peer_locks[src]:
            await chan.send({"t": "ready"})
            await asyncio.to_thread(_exchange, tensors, src, tag, False, self.config.transfer_timeout_s,
                                    tagger.tag if tagger else None)
