"""DSpark on a tensor-parallel engine: the draft runs on the target's ranks, sharded like the target
(`draft_tensor_parallel_size` = the target's `--tensor-parallel-size`).

| draft part | split | put back together by |
|---|---|---|
| `q_b_proj`, `kv_b_proj` (MLA) / `q_proj`, `k_proj`, `v_proj` (GQA) | heads (output rows) | - |
| `o_proj` | heads (input columns) | all-reduce |
| MLP `gate/up` / `down` | columns / rows | all-reduce |
| `context_proj`, norms, `kv_a_proj_with_mqa`, Markov and confidence heads | replicated | - |
| embedding, LM head | the target's vocabulary-parallel ones | all-reduce / all-gather |

The draft cache rows (MLA latent, or GQA K/V of every KV head) are computed from replicated inputs,
so every rank holds them whole, as the target's MLA pages. Rank 0 drives: before writing context rows
or drafting it broadcasts the command (`draft_context` with the verified tokens' features,
`draft_propose` with the requests), every rank runs the same forward and so the same collectives,
and rank 0 alone runs the Markov sampling loop on the all-gathered logits.
"""
from __future__ import annotations

from typing import Any, cast

import torch

from engine.parallel.comm import TPGroup
from engine.parallel.layers import RowParallelLinear, shard_in, shard_out
from engine.spec_decode.config import SpecConfigError, SpeculativeConfig, read_draft_config
from engine.spec_decode.draft_model import DraftLayer, DSparkDraftModel
from engine.spec_decode.proposer import ContextRows, DraftBlock, DraftRequest, DSparkProposer


def check_before_ranks(config: Any) -> None:
    """A speculative config that cannot run stops start-up before any other rank is started (EngineConfig)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is not None:
        spec.check_draft_tp(config.tensor_parallel_size)
        read_draft_config(spec.with_model_path().model)


def _range(total: int, rank: int, world: int) -> tuple[int, int]:
    step = total // world
    return rank * step, (rank + 1) * step


@torch.no_grad()
def shard_draft(model: DSparkDraftModel, group: TPGroup) -> None:
    """Keep this rank's heads and MLP columns of every draft layer (in place)."""
    rank, world = group.rank, group.world_size
    for layer in cast("list[DraftLayer]", model.layers):        # an nn.ModuleList of them
        attn, mlp = cast(Any, layer.self_attn), cast(Any, layer.mlp)    # their linears become parallel wrappers
        heads, width = attn.num_heads, mlp.gate_proj.out_features
        if heads % world or width % world:
            raise SpecConfigError(f"draft heads ({heads}) and intermediate size ({width}) must divide over "
                                  f"tensor_parallel_size {world}")
        for name, per_head, count in attn.head_split():
            h0, h1 = _range(count, rank, world)
            setattr(attn, name, shard_out(getattr(attn, name), h0 * per_head, h1 * per_head))
        h0, h1 = _range(heads, rank, world)
        attn.o_proj = RowParallelLinear(shard_in(attn.o_proj, h0 * attn.v_dim, h1 * attn.v_dim), group)
        attn.shard_heads(h1 - h0, rank)
        lo, hi = _range(width, rank, world)
        mlp.gate_proj, mlp.up_proj = shard_out(mlp.gate_proj, lo, hi), shard_out(mlp.up_proj, lo, hi)
        mlp.down_proj = RowParallelLinear(shard_in(mlp.down_proj, lo, hi), group)


class TPProposer(DSparkProposer):
    """Rank 0's proposer: broadcasts each draft command, then runs it as rank 0's share."""

    def __init__(self, spec: SpeculativeConfig, target_model, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, group: TPGroup) -> None:
        super().__init__(spec, target_model, num_blocks, block_size, dtype, device)
        shard_draft(self.model, group)
        self.group, self.num_blocks = group, num_blocks

    def setup_command(self) -> tuple:
        """What the other ranks need to build their share (sent once, after the runner exists)."""
        return ("draft_setup", self.spec, self.num_blocks, self.block_size)

    def write_rows(self, rows: ContextRows) -> None:
        rows = ContextRows(rows.slots, rows.positions, rows.features.cpu())
        self.group.broadcast(("draft_context", rows))
        super().write_rows(rows)

    def propose(self, reqs: list[DraftRequest]) -> list[DraftBlock]:
        if reqs:
            self.group.broadcast(("draft_propose", reqs))
        return super().propose(reqs)


def apply_draft_command(runner: Any, kind: str, args: tuple) -> None:
    """A follower rank's replay of rank 0's draft command (`runner`: its ShardedRunner)."""
    if kind == "draft_setup":
        spec, num_blocks, block_size = args
        runner.proposer = DSparkProposer(spec, runner.model, num_blocks, block_size, runner.dtype, runner.device)
        shard_draft(runner.proposer.model, runner.group)
    elif kind == "draft_context":
        rows = args[0]
        runner.proposer.write_rows(ContextRows(rows.slots, rows.positions, rows.features.to(runner.device)))
    elif kind == "draft_propose":
        runner.proposer.block_logits(args[0])
    else:
        raise RuntimeError(f"unknown draft command {kind!r}")
