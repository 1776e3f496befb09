"""The process group of one engine's ranks and the few collectives the sharded model uses.

gloo on CPU, nccl on CUDA, hccl on Ascend NPUs (torch-npu); control messages (the commands rank 0
broadcasts) always go over a gloo group, so they never need device buffers. One group per process:
an engine with TP > 1 owns the default process group until `close()`.

Two clocks: the model's collectives (and gathers to rank 0) time out after `collective_timeout_s()`
(120 s, $KIMI_PD_TP_TIMEOUT_S), so a rank that stops answering mid-step fails the step; a follower
waiting for rank 0's next command waits on a group of its own with a timeout of days, because an
idle worker sends no commands at all (with one clock, 120 quiet seconds killed every follower).
The rendezvous is rank 0's `master_addr:port`; on another host gloo talks over the interface that
reaches it ($GLOO_SOCKET_IFNAME unless already set), never loopback.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
TP_TIMEOUT_ENV = "KIMI_PD_TP_TIMEOUT_S"
IDLE_TIMEOUT_S = 7 * 24 * 3600.0          # waiting for the next command: an idle worker may stay idle for days


def collective_timeout_s() -> float:
    """How long a rank waits for the others inside one step before the step fails."""
    return float(os.environ.get(TP_TIMEOUT_ENV) or 120.0)


def rank_device(device: str, rank: int) -> str:
    """Rank r of an accelerator engine uses accelerator r (`cuda` -> `cuda:r`); CPU ranks share the CPU."""
    kind = torch.device(device).type
    return device if kind == "cpu" else f"{kind}:{rank}"


@dataclass
class TPGroup:
    """This process's place in the engine's ranks, and the collectives over them."""

    rank: int
    world_size: int
    control: Any            # gloo group for rank 0's pickled commands: the idle clock
    sync: Any = None        # gloo group for gathers to rank 0: the collective clock
    tensor: Any = None      # the model's collectives (None: the default group; a subgroup under DP)
    leader: int = 0         # global rank of this group's rank 0 (DP rank d's leader is d x TP)

    @classmethod
    def join(cls, rank: int, world_size: int, port: int, device: str, timeout_s: float | None = None,
             master_addr: str = "127.0.0.1") -> TPGroup:
        backend = _BACKENDS.get(torch.device(device).type, "gloo")
        from engine.parallel.netif import pin_gloo_interface
        pin_gloo_interface(master_addr)
        timeout = datetime.timedelta(seconds=timeout_s or collective_timeout_s())
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size,
                                timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
        sync = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank, world_size, control, sync)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- tensor collectives (the model's) -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.tensor)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tensor)
        return torch.cat(parts, dim=dim)

    # ---- control (rank 0 -> all) ----------------------------------------------------------------
    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.leader, group=self.sync)
        return out
