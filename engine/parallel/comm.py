"""The process group of one engine's ranks and the few collectives the sharded model uses.

gloo on CPU, nccl on CUDA, hccl on Ascend NPUs (torch-npu); control messages (the commands rank 0
broadcasts) always go over a gloo group, so they never need device buffers. One group per process:
an engine with TP > 1 owns the default process group until `close()`.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def rank_device(device: str, rank: int) -> str:
    """Rank r of an accelerator engine uses accelerator r (`cuda` -> `cuda:r`); CPU ranks share the CPU."""
    kind = torch.device(device).type
    return device if kind == "cpu" else f"{kind}:{rank}"


@dataclass
class TPGroup:
    """This process's place in the engine's ranks, and the collectives over them."""

    rank: int
    world_size: int
    control: Any            # gloo group for pickled commands

    @classmethod
    def join(cls, rank: int, world_size: int, port: int, device: str, timeout_s: float = 120.0) -> TPGroup:
        backend = _BACKENDS.get(torch.device(device).type, "gloo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        return cls(rank, world_size, control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- tensor collectives (the model's) -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    # ---- control (rank 0 -> all) ----------------------------------------------------------------
    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out
