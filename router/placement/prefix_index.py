"""Which prompt blocks each worker caches, as chained block hashes (shared.hashing).

Two indexes with one query, `matched_blocks(worker_id, prompt_hashes)`: the number of leading
prompt blocks the worker holds, stopping at the first miss. Block i's hash chains over blocks
0..i, so a hit on block i without block i-1 cannot be reused and is not counted.

- `PrefixIndex`: exact, fed by the workers' KV events (vLLM schema). Unbounded by itself; the
  workers' `BlockRemoved` events bound it.
- `ApproximatePrefixIndex`: for workers that publish no events (stock vLLM). Remembers what the
  router sent each worker, as an LRU bounded to that worker's cache capacity in blocks (an index
  larger than the cache believes in blocks the worker evicted long ago and sends prompts there).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Protocol

from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)


class PrefixQuery(Protocol):
    def matched_blocks(self, worker_id: str, prompt_hashes: Sequence[int]) -> int: ...


def _leading_hits(held: set[int] | OrderedDict[int, None], prompt_hashes: Sequence[int]) -> int:
    count = 0
    for h in prompt_hashes:
        if h not in held:
            break
        count += 1
    return count


class PrefixIndex:
    """worker_id -> set of cached block hashes, exact as long as no event is lost.

    Events must be applied in the order the worker published them. `medium` (GPU/CPU tier) is
    ignored: a block counts as cached while any event says so, and any removal drops it, which can
    only under-count. A gap in the worker's event sequence means the caller must reload a snapshot.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}

    def apply(self, worker_id: str, batch: KVEventBatch) -> None:
        """Apply a batch's events in order. Mutates only `worker_id`'s set."""
        blocks = self._blocks.setdefault(worker_id, set())
        for event in batch.events:
            _apply_event(blocks, event)

    def load_snapshot(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Replace everything known about `worker_id` with a snapshot of its cache."""
        self._blocks[worker_id] = set(hashes)

    def drop_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def blocks(self, worker_id: str) -> frozenset[int]:
        """A copy of the worker's cached hashes (what a snapshot of it would hold)."""
        return frozenset(self._blocks.get(worker_id, ()))

    def matched_blocks(self, worker_id: str, prompt_hashes: Sequence[int]) -> int:
        return _leading_hits(self._blocks.get(worker_id, set()), prompt_hashes)


def _apply_event(blocks: set[int], event: KVEvent) -> None:
    if isinstance(event, BlockStored):
        blocks.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        blocks.difference_update(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        blocks.clear()
    else:
        raise TypeError(f"not a KV event: {event!r}")


class ApproximatePrefixIndex:
    """What the router sent each worker, newest last, at most `capacity_blocks` hashes per worker.

    `record` touches a prompt's blocks from the LAST to the FIRST, so block 0 is the most recent
    and eviction takes a prompt's tail before its head: like the engine's own LRU, which frees a
    request's blocks in reverse, and because evicting block 0 would void every later block.
    Queries do not change recency. `capacity_blocks` applies to workers whose own capacity was
    never given (`set_capacity`).
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        """The worker's prefix cache holds `blocks` blocks; shrinks its entry now if needed."""
        if blocks < 1:
            raise ValueError(f"capacity must be >= 1 block, got {blocks}")
        self._capacity[worker_id] = blocks
        self._evict(worker_id)

    def capacity(self, worker_id: str) -> int:
        return self._capacity.get(worker_id, self.capacity_blocks)

    def record(self, worker_id: str, prompt_hashes: Sequence[int]) -> None:
        """Note that `worker_id` was sent a prompt with these block hashes; evicts the oldest
        entries beyond capacity."""
        lru = self._lru.setdefault(worker_id, OrderedDict())
        for h in reversed(prompt_hashes):
            lru[h] = None
            lru.move_to_end(h)
        self._evict(worker_id)

    def record_many(self, worker_id: str, prompts: Sequence[Sequence[int]]) -> None:
        """`record` of each prompt in turn, in one pass: the same entry afterwards, at the cost of the
        distinct hashes rather than all of them (a router process replaying its siblings' sends gets
        many prompts per worker that share their leading blocks).

        Why it is the same: an LRU holds the `capacity` most recently touched hashes in the order of
        their last touch, and evicting along the way or once at the end keeps the same ones."""
        if len(prompts) == 1:
            self.record(worker_id, prompts[0])
            return
        touches = list(chain.from_iterable(reversed(p) for p in prompts))       # in the order record makes them
        newest_first = dict.fromkeys(reversed(touches))                         # each hash at its last touch
        lru = self._lru.setdefault(worker_id, OrderedDict())
        for h in reversed(newest_first):
            lru[h] = None
            lru.move_to_end(h)
        self._evict(worker_id)

    def _evict(self, worker_id: str) -> None:
        lru, cap = self._lru.get(worker_id), self.capacity(worker_id)
        while lru is not None and len(lru) > cap:
            lru.popitem(last=False)

    def drop_worker(self, worker_id: str) -> None:
        self._lru.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))

    def matched_blocks(self, worker_id: str, prompt_hashes: Sequence[int]) -> int:
        return _leading_hits(self._lru.get(worker_id, OrderedDict()), prompt_hashes)
