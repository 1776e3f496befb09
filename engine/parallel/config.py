"""The parallel layout an engine runs with (vLLM's `--tensor-parallel-size`, `--enable-expert-parallel`)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.model_config import TextConfig


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False     # routed experts split whole across the TP (x DP) ranks
    data_parallel_size: int = 1              # > 1: the routed experts spread over DP x TP ranks

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1 or self.data_parallel_size > 1

    def check(self, cfg: TextConfig) -> None:
        """Every sharded dimension must split evenly; raise naming the first that does not."""
        n = self.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
        if self.data_parallel_size > 1:
            self._check_experts(cfg)
        if n == 1:
            return
        dims = {"num_attention_heads (MLA)": cfg.num_attention_heads,
                "linear_attn_config.num_heads (KDA)": cfg.linear_attn_config.num_heads,
                "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
        if cfg.num_shared_experts:
            dims["num_shared_experts * moe_intermediate_size"] = cfg.num_shared_experts * cfg.moe_intermediate_size
        if self.enable_expert_parallel:
            dims["num_experts"] = cfg.num_experts
        else:
            # W4A8 packs two output rows per byte: each rank's expert slice must stay even.
            dims["moe_intermediate_size / 2 (int4 packing)"] = cfg.moe_intermediate_size // 2
        bad = [f"{name}={value}" for name, value in dims.items() if value % n]
        if bad:
            raise ValueError(f"tensor_parallel_size={n} does not divide {', '.join(bad)}")

    def _check_experts(self, cfg: TextConfig) -> None:
        """The routed experts split over every DP x TP rank: whole ones with EP, else by intermediate dim."""
        ranks = self.data_parallel_size * self.tensor_parallel_size
        if self.enable_expert_parallel and cfg.num_experts % ranks:
            raise ValueError(f"expert parallelism over {ranks} ranks (data x tensor parallel) does not divide "
                             f"num_experts={cfg.num_experts}")
        if not self.enable_expert_parallel and (cfg.moe_intermediate_size % ranks or cfg.quantization_config):
            raise ValueError(f"data_parallel_size > 1 without --enable-expert-parallel splits every expert's "
                             f"moe_intermediate_size={cfg.moe_intermediate_size} over {ranks} ranks: it must "
                             "divide, and the checkpoint must be float; use --enable-expert-parallel")
