"""The process groups of a data-parallel engine, its expert-parallel MoE exchange, and the dummy step.

One world of D x T ranks (`dp_config.py`). Groups, created in the same order on every rank:

| group | ranks | carries |
|---|---|---|
| TP group of DP rank d (+ gloo control/sync) | d x T .. d x T + T - 1 | attention/dense collectives, commands |
| DP command + DP sync (gloo) | every DP rank's leader | the front's commands, results gathered back |
| the world (EP group) | all D x T | the routed experts' token exchange |

MoE: each EP rank holds E / (D x T) whole experts. A layer all-gathers every DP rank's routed tokens
(latent activations, weights and expert ids, one packed fp64 row per token; the T ranks of a DP rank
hold the same tokens, so one copy per DP rank is used), runs its experts on all of them, and all-reduces
the partial sums; each rank keeps its own DP rank's rows. All-gather + all-reduce rather than
all-to-all: every rank sees the same tokens in the same order, the sizes are known from one small
gather, and there is no per-expert routing table to exchange; it moves D x more activation bytes than
an all-to-all, which on tiny models and gloo is cheaper than its extra round of size exchanges.
A DP rank without work runs the same collectives with zero tokens (`dummy_step`), so nobody waits.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.model.layers import upcast
from engine.parallel.comm import _BACKENDS, IDLE_TIMEOUT_S, TPGroup, collective_timeout_s
from engine.parallel.dp_config import DPLayout
from shared.errors import InvalidRequest


@dataclass
class ExpertParallel:
    """This rank's place in the expert-parallel group (the whole world) and the MoE token exchange."""

    rank: int                  # global rank
    world_size: int            # D x T
    tensor_parallel_size: int  # T: one copy of a DP rank's tokens every T ranks
    dp_rank: int

    def routed(self, moe, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This DP rank's routed sum [n, latent] over every rank's experts (exchange, compute, reduce)."""
        n, width, k = h.shape[0], h.shape[1], ids.shape[1]
        counts = [torch.zeros(1, dtype=torch.long, device=h.device) for _ in range(self.world_size)]
        dist.all_gather(counts, torch.tensor([n], dtype=torch.long, device=h.device))   # nccl/hccl: on device
        per_dp = [int(c) for c in counts[:: self.tensor_parallel_size]]
        total, most = sum(per_dp), max(per_dp)
        out_dtype = upcast(h).dtype
        if total == 0:
            return torch.zeros(h.shape, dtype=out_dtype, device=h.device)
        packed = torch.zeros(most, width + 2 * k, dtype=torch.float64, device=h.device)
        packed[:n] = torch.cat([h.double(), weights.double(), ids.double()], dim=-1)
        parts = [torch.empty_like(packed) for _ in range(self.world_size)]
        dist.all_gather(parts, packed)
        rows = torch.cat([parts[d * self.tensor_parallel_size][:c] for d, c in enumerate(per_dp)])
        y = moe._routed_dispatch(rows[:, :width].to(h.dtype), rows[:, width: width + k].to(weights.dtype),
                                 rows[:, width + k:].long())
        dist.all_reduce(y)
        first = sum(per_dp[: self.dp_rank])
        return y[first: first + n].to(out_dtype)

    def dummy(self, moe, dtype: torch.dtype) -> None:
        """This layer's exchange with no tokens of this DP rank (its experts still serve the others);
        `dtype` is the model's, so gathered rows are computed exactly as on the ranks that sent them."""
        device = moe.gate.e_score_correction_bias.device
        empty = torch.zeros(0, moe.routed_expert_down_proj.out_features, dtype=dtype, device=device)
        self.routed(moe, empty, torch.zeros(0, moe.top_k, dtype=upcast(empty).dtype, device=device),
                    torch.zeros(0, moe.top_k, dtype=torch.long, device=device))


@torch.inference_mode()
def dummy_step(model) -> None:
    """A forward's MoE exchanges and nothing else: what a DP rank with no work runs in a step."""
    inner = model.language_model.model
    dtype = inner.embed_tokens.weight.dtype
    for layer in inner.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and moe.expert_parallel is not None:
            moe.expert_parallel.dummy(moe, dtype)


@dataclass
class DPChannel:
    """The front's commands to every DP leader and their answers (gloo; rank 0 is the front)."""

    control: Any
    sync: Any
    size: int
    is_front: bool

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.size if self.is_front else None
        dist.gather_object(obj, out, dst=0, group=self.sync)
        return out


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (to travel to the front); else an InvalidRequest with the same
    message, param and error code (so the client still gets its 400), or a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure: send its text instead
        if isinstance(exc, InvalidRequest):
            plain = InvalidRequest(exc.message, exc.param)
            plain.code = exc.code
            return plain
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def join_dp(layout: DPLayout, rank: int, device: str) -> tuple[TPGroup, ExpertParallel, DPChannel | None]:
    """Join the world as global `rank` and build every group (all ranks create all, in one order)."""
    backend = _BACKENDS.get(torch.device(device).type, "gloo")
    from engine.parallel.netif import pin_gloo_interface
    pin_gloo_interface(layout.address)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    idle = datetime.timedelta(seconds=IDLE_TIMEOUT_S)
    dist.init_process_group(backend, init_method=f"tcp://{layout.address}:{layout.rpc_port}", rank=rank,
                            world_size=layout.world_size, timeout=timeout)
    made = []
    for d in range(layout.size):
        ranks = layout.tp_ranks(d)
        tensor = dist.new_group(ranks, timeout=timeout, backend=backend)
        control = dist.new_group(ranks, timeout=idle, backend="gloo")
        sync = tensor if backend == "gloo" else dist.new_group(ranks, timeout=timeout, backend="gloo")
        made.append((tensor, control, sync))
    dp_control = dist.new_group(layout.leaders(), timeout=idle, backend="gloo")
    dp_sync = dist.new_group(layout.leaders(), timeout=timeout, backend="gloo")
    tp = layout.tensor_parallel_size
    d, t = divmod(rank, tp)
    tensor, control, sync = made[d]
    group = TPGroup(t, tp, control, sync, tensor=tensor, leader=layout.global_rank(d))
    channel = DPChannel(dp_control, dp_sync, layout.size, rank == 0) if t == 0 else None
    return group, ExpertParallel(rank, layout.world_size, tp, d), channel
