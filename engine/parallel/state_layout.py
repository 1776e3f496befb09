"""KDA state between the TP=1 layout (what is exported and transferred) and one rank's head shard.

MLA latents are replicated on every rank, so they travel as they are. A KDA state is sharded by heads:
`kda_recurrent [H, K, V]` splits on dim 0; `kda_conv [W-1, 3*H*K]` holds the q, k and v channels one
after another, so a rank's shard is its heads' channels of each of the three. Pure functions: resharding
is `gather` on export (TP=N prefill) and `split` on import (TP=M decode), for any N and M.
"""
from __future__ import annotations

import torch


def split_conv(conv: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """[W-1, 3*H*K] -> this rank's [W-1, 3*H*K/world]."""
    parts = conv.chunk(3, dim=-1)
    return torch.cat([p.chunk(world, dim=-1)[rank] for p in parts], dim=-1).contiguous()


def gather_conv(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_conv` over all ranks' shards, in rank order."""
    groups = [s.chunk(3, dim=-1) for s in shards]
    return torch.cat([torch.cat([g[i] for g in groups], dim=-1) for i in range(3)], dim=-1)


def split_recurrent(state: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """[H, K, V] -> this rank's [H/world, K, V]."""
    return state.chunk(world, dim=0)[rank].contiguous()


def gather_recurrent(shards: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(shards, dim=0)


def split_kda(conv: dict[int, torch.Tensor], rec: dict[int, torch.Tensor], rank: int, world: int
              ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """A whole request's KDA state (every layer) -> this rank's shard."""
    return ({i: split_conv(c, rank, world) for i, c in conv.items()},
            {i: split_recurrent(r, rank, world) for i, r in rec.items()})


def gather_kda(shards: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]
               ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Every rank's (conv, recurrent) shard, in rank order -> the TP=1 layout."""
    layers = shards[0][0].keys()
    return ({i: gather_conv([s[0][i] for s in shards]) for i in layers},
            {i: gather_recurrent([s[1][i] for s in shards]) for i in layers})
