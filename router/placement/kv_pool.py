"""A KV pool shared by the prefill workers, as placement sees it.

Some fleets put a shared KV store behind their prefill workers: vLLM-Ascend's `AscendStoreConnector`
(memcache or Mooncake Store, inside a `MultiConnector` beside the P/D connector), vLLM with LMCache or
Mooncake Store. A prefill worker saves the blocks it computes there and loads any block it finds there
instead of computing it. So a prompt prefix that one worker computed is a cheap hit on every other
worker too, and a request need not wait for the one worker that holds its prefix locally.

The router cannot see inside the pool (these stores publish no KV events), so like the approximate index
it remembers what it sent: every prompt a pool member (a prefill or colocated worker) computed is in the
pool from when the router sees its leg answered (the worker saves the blocks as it computes them), newest
last, up to the pool's capacity in blocks. A block loaded from the pool costs the worker
`load_cost` of what computing it costs (the store's read bandwidth against the worker's prefill speed:
measure both on the fleet you run), and it is not charged the recompute weight placement puts on
computed tokens: the pool still holds the block for later requests.

Membership is by role: every prefill and colocated worker of the router counts as reading and filling the
one pool.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.prefix_index import ApproximatePrefixIndex
from shared.workers import Role

# the roles that compute prompts and so read and fill a prefill-side pool; decode workers get their KV by transfer
POOL_ROLES: frozenset[Role] = frozenset({"prefill", "both"})
_POOL = "kv-pool"


@dataclass(frozen=True)
class KVPoolConfig:
    """`blocks`: the pool's capacity in the workers' KV blocks (0: no pool); `load_cost`: a token loaded
    from the pool costs this share of computing it (0 < load_cost <= 1)."""

    blocks: int = 0
    load_cost: float = 0.1

    def __post_init__(self) -> None:
        if self.blocks < 0:
            raise ValueError(f"kv pool blocks must be >= 0, got {self.blocks}")
        if not 0 < self.load_cost <= 1:
            raise ValueError(f"kv pool load cost must be in (0, 1], got {self.load_cost}")

    @property
    def enabled(self) -> bool:
        return self.blocks > 0


class KVPool:
    """What the pool holds, approximately: an LRU of the block hashes of the prompts members computed."""

    def __init__(self, config: KVPoolConfig) -> None:
        if not config.enabled:
            raise ValueError("a KVPool needs a capacity of at least one block")
        self.config = config
        self._index = ApproximatePrefixIndex(config.blocks)

    @staticmethod
    def member(role: Role) -> bool:
        return role in POOL_ROLES

    def record(self, prompt_hashes: Sequence[int]) -> None:
        self._index.record(_POOL, prompt_hashes)

    def matched_blocks(self, prompt_hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt the pool holds (a chain: a miss ends it)."""
        return self._index.matched_blocks(_POOL, prompt_hashes)

    def num_blocks(self) -> int:
        return self._index.num_blocks(_POOL)
