"""MLA latent page pool with prefix caching.

Invariants (checked by `check_integrity`):
- a block is either in use (ref_count > 0) or in the free queue (ref_count == 0), never both;
- the free queue's order is the eviction order (least recently freed first);
- `hash_to_block[h] == b` iff `block_hash[b] == h`; a cached free block keeps its hash until reused;
- block 0 is never handed out: it is the null page that padding may point at.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.ref_count[0] = 1                                   # the null block
        self._evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def lookup(self, block_hash: int) -> int | None:
        return self.hash_to_block.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._drop_hash(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free_queue[block]
            self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each; pass blocks in order, the tail of a sequence is evicted first."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self.ref_count[block] == 0:
                self.free_queue[block] = None

    def cache(self, block: int, block_hash: int) -> None:
        """Publish a full block under its hash (first writer wins; duplicates stay uncached)."""
        if self.block_hash[block] is not None or block_hash in self.hash_to_block:
            return
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block

    def evicted_hashes(self) -> list[int]:
        """Hashes dropped since the last call (for KV events)."""
        out, self._evicted = self._evicted, []
        return out

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block] = None
            self._evicted.append(h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if any(self.ref_count[1:]):
            return False
        for block in range(1, self.num_blocks):
            self._drop_hash(block)
        return True

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise if the pool disagrees with `expected_refs` (block -> references held by requests)."""
        for block in range(1, self.num_blocks):
            want = expected_refs.get(block, 0)
            if self.ref_count[block] != want:
                raise AssertionError(f"block {block}: ref_count {self.ref_count[block]}, holders {want}")
            if (want == 0) != (block in self.free_queue):
                raise AssertionError(f"block {block}: ref_count {want} but in free queue: {block in self.free_queue}")
        for h, block in self.hash_to_block.items():
            if self.block_hash[block] != h:
                raise AssertionError(f"hash map points {h} at block {block}, which holds {self.block_hash[block]}")
        if sum(h is not None for h in self.block_hash) != len(self.hash_to_block):
            raise AssertionError("a block keeps a hash the map does not know")
