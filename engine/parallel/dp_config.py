"""Where the ranks of a data-parallel engine live (vLLM's `--data-parallel-*` flags, their meaning).

D data-parallel ranks, each a whole engine (scheduler, batch, cache) over T tensor-parallel ranks:
D x T processes in one torch.distributed world, global rank g = d x T + t. DP rank d's rank t = 0 is
its leader (it runs that rank's LLMEngine); global rank 0 is DP rank 0's leader and the front (it
serves and places requests). A host runs `data_parallel_size_local` consecutive DP ranks from
`data_parallel_start_rank`; node 0 (start rank 0) serves, the others run `--headless`. Every rank
meets at `data_parallel_address:data_parallel_rpc_port`, which also carries the front's commands.
Torch-free, so flags are checked before anything loads.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DataParallelSettings:
    """EngineConfig's data-parallel fields (vLLM's --data-parallel-*), keyword-only so they may follow
    EngineConfig's own fields."""

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None     # None: every DP rank from the start rank on this host
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0                  # 0: any free port (one host only)


@dataclass(frozen=True)
class DPLayout:
    size: int                 # D
    size_local: int           # DP ranks on this host
    start_rank: int           # the first of them
    tensor_parallel_size: int  # T
    address: str = "127.0.0.1"
    rpc_port: int = 0

    @classmethod
    def of(cls, config) -> DPLayout:
        """The layout an EngineConfig asks for (checked)."""
        size = config.data_parallel_size
        local = config.data_parallel_size_local
        start = config.data_parallel_start_rank
        layout = cls(size, size - start if local is None else local, start, config.tensor_parallel_size,
                     config.data_parallel_address, config.data_parallel_rpc_port)
        layout.check(config)
        return layout

    def check(self, config) -> None:
        """Refuse a layout that cannot run, naming the flag."""
        if self.size < 1 or self.size_local < 1 or self.start_rank < 0:
            raise ValueError("--data-parallel-size and --data-parallel-size-local must be >= 1, "
                             "--data-parallel-start-rank >= 0")
        if self.start_rank + self.size_local > self.size:
            raise ValueError(f"--data-parallel-start-rank {self.start_rank} + --data-parallel-size-local "
                             f"{self.size_local} exceeds --data-parallel-size {self.size}")
        if self.size > 1 and config.nnodes > 1:
            raise ValueError("with --data-parallel-size > 1 each DP rank's tensor-parallel ranks stay on one host: "
                             "spread DP ranks with --data-parallel-size-local/--data-parallel-start-rank, "
                             "not --nnodes")
        if self.size_local < self.size and not self.rpc_port:
            raise ValueError("DP ranks on several hosts meet at --data-parallel-address:--data-parallel-rpc-port: "
                             "give --data-parallel-rpc-port")

    @property
    def world_size(self) -> int:
        return self.size * self.tensor_parallel_size

    def global_rank(self, dp_rank: int, tp_rank: int = 0) -> int:
        return dp_rank * self.tensor_parallel_size + tp_rank

    def tp_ranks(self, dp_rank: int) -> list[int]:
        """The global ranks of DP rank `dp_rank`'s tensor-parallel group."""
        return [self.global_rank(dp_rank, t) for t in range(self.tensor_parallel_size)]

    def leaders(self) -> list[int]:
        """Every DP rank's rank t = 0, in DP order: the front's command group."""
        return [self.global_rank(d) for d in range(self.size)]

    def local_ranks(self) -> list[int]:
        """The global ranks this host runs."""
        first = self.global_rank(self.start_rank)
        return list(range(first, first + self.size_local * self.tensor_parallel_size))
