"""Hybrid cache facade: MLA pages (BlockPool) + KDA state slots (StateSlotPool) behind one interface.

The scheduler asks it three things: how much of a prompt is already cached (`prefix_hit`), whether a
request can have room for n more tokens (`allocate`), and which KDA snapshots to take while computing
(`plan_snapshots`). After the forward pass the engine calls `commit` to publish what became reusable.
A prefix hit is usable only where BOTH the MLA blocks and a KDA snapshot exist, and never covers the
whole prompt (the last prompt token must be computed to get logits).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.request import Request
from engine.core.state_slots import StateSlotPool
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shared.model_config import TextConfig


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    num_working_slots: int
    num_snapshot_slots: int
    enable_prefix_caching: bool = True
    snapshot_interval_blocks: int = 4
    spec_slots_per_seq: int = 0          # per-position KDA slots of each working slot (speculative decoding)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def bytes_per_block(cfg: TextConfig, block_size: int, dtype_bytes: int) -> int:
    return len(cfg.mla_layer_ids) * block_size * cfg.mla_cache_dim * dtype_bytes


def bytes_per_slot(cfg: TextConfig, dtype_bytes: int) -> int:
    lac = cfg.linear_attn_config
    conv = (lac.short_conv_kernel_size - 1) * 3 * cfg.kda_projection_size * dtype_bytes
    recurrent = lac.num_heads * lac.head_dim * lac.head_dim * 4
    return len(cfg.kda_layer_ids) * (conv + recurrent)


def budget_cache(cfg: TextConfig, memory_bytes: int, block_size: int, num_working_slots: int,
                 num_snapshot_slots: int, dtype_bytes: int, enable_prefix_caching: bool,
                 snapshot_interval_blocks: int, spec_slots_per_seq: int = 0, extra_block_bytes: int = 0) -> CacheConfig:
    """Split a memory budget: state slots first (fixed per sequence), the rest becomes MLA pages.

    Speculative decoding adds `spec_slots_per_seq` per-position KDA slots per working slot and the
    draft's context rows to every block (`extra_block_bytes`)."""
    num_slots = num_working_slots * (1 + spec_slots_per_seq) + num_snapshot_slots
    slot_bytes = num_slots * bytes_per_slot(cfg, dtype_bytes)
    block_bytes = max(1, bytes_per_block(cfg, block_size, dtype_bytes) + extra_block_bytes)
    num_blocks = (memory_bytes - slot_bytes) // block_bytes
    if num_blocks < 2:
        raise ValueError(f"cache memory {memory_bytes} B is too small: {slot_bytes} B go to "
                         f"{num_working_slots + num_snapshot_slots} KDA state slots, "
                         f"one MLA block needs {block_bytes} B")
    return CacheConfig(block_size, int(num_blocks), num_working_slots, num_snapshot_slots,
                       enable_prefix_caching, snapshot_interval_blocks, spec_slots_per_seq)


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int
    blocks: list[int]
    snapshot_slot: int | None

    @staticmethod
    def none() -> PrefixHit:
        return PrefixHit(0, [], None)


class HybridCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.slots = StateSlotPool(config.num_working_slots, config.num_snapshot_slots)
        self._pending: dict[str, list[tuple[int, int]]] = {}
        self._events: list[KVEvent] = []

    # ---- lookups ------------------------------------------------------------------------------
    def prefix_hit(self, req: Request) -> PrefixHit:
        if not self.config.enable_prefix_caching or req.imported is not None or req.wants_prompt_logprobs:
            return PrefixHit.none()             # prompt logprobs need every prompt position's logits
        max_blocks = (req.num_prompt_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        for n in range(len(blocks), 0, -1):
            slot = self.slots.snapshot_for(req.block_hashes[n - 1])
            if slot is not None:
                return PrefixHit(n * self.block_size, blocks[:n], slot)
        return PrefixHit.none()

    def blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        have = len(req.blocks) + (len(hit.blocks) if hit else 0)
        computed = hit.num_tokens if hit else req.num_computed_tokens
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - have)

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (adopting `hit` first); False if it does not fit."""
        needs_slot = req.kda_slot is None
        if needs_slot and self.slots.num_free_working == 0:
            return False
        hit_free = sum(1 for b in (hit.blocks if hit else []) if self.pool.ref_count[b] == 0)
        if self.blocks_needed(req, num_new_tokens, hit) > self.pool.num_free - hit_free:
            return False
        if hit and hit.blocks:
            self.pool.touch(hit.blocks)
            req.blocks = list(hit.blocks)
            req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
            req.num_published_blocks = req.snapshot_upto_blocks = len(hit.blocks)
            req.resume_snapshot_slot = hit.snapshot_slot
        req.blocks += self.pool.allocate(self.blocks_needed(req, num_new_tokens))
        if needs_slot:
            req.kda_slot = self.slots.take_working()
        return True

    def plan_snapshots(self, req: Request, start: int, num_new: int) -> tuple[tuple[int, int], ...]:
        """(offset within the new tokens, slot) for each prompt block boundary in (start, start+num_new]
        that should keep a KDA snapshot: every `snapshot_interval_blocks` blocks and the prompt's last
        full boundaries (so the same prompt, or its continuation, hits again)."""
        if not self.config.enable_prefix_caching:
            return ()
        bs, n_prompt = self.block_size, req.num_prompt_tokens
        ends = {n_prompt // bs, (n_prompt - 1) // bs}
        plan = []
        # latest boundary first: when slots are short, the snapshot nearest the prompt end matters most
        for b in reversed(range(start // bs + 1, min(start + num_new, n_prompt) // bs + 1)):
            if b % self.config.snapshot_interval_blocks and b not in ends:
                continue
            slot = self.slots.reserve_snapshot(req.block_hashes[b - 1])
            if slot is not None or self.slots.snapshot_for(req.block_hashes[b - 1]) is not None:
                req.snapshot_upto_blocks = max(req.snapshot_upto_blocks, b)
            if slot is not None:
                self._pending.setdefault(req.request_id, []).append((req.block_hashes[b - 1], slot))
                plan.append((b * bs - start, slot))
        return tuple(sorted(plan))

    def commit(self, req: Request) -> None:
        """After a forward: publish the request's newly full prompt blocks and written snapshots.

        Only blocks up to the furthest KDA snapshot are published: a hybrid prefix can resume only at
        a snapshot, so pages past it (or an imported prompt's pages) are never announced as reusable.
        """
        full = min(len(req.block_hashes), req.num_computed_tokens // self.block_size, req.snapshot_upto_blocks)
        first = req.num_published_blocks
        for i in range(first, full):
            self.pool.cache(req.blocks[i], req.block_hashes[i])
        if full > first:
            self._flush_evictions()
            bs = self.block_size
            parent = req.block_hashes[first - 1] if first else None
            self._events.append(BlockStored(req.block_hashes[first:full], parent,
                                            req.prompt_token_ids[first * bs: full * bs], bs))
        req.num_published_blocks = max(req.num_published_blocks, full)
        for block_hash, slot in self._pending.pop(req.request_id, []):
            self.slots.commit_snapshot(block_hash, slot)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (pages of rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(req.blocks) > keep:
            self.pool.free(req.blocks[keep:])
            del req.blocks[keep:]

    def free(self, req: Request) -> None:
        """Return everything `req` holds. Safe to call twice."""
        self.pool.free(req.blocks)
        req.blocks = []
        if req.kda_slot is not None:
            self.slots.release_working(req.kda_slot)
            req.kda_slot = None
        req.resume_snapshot_slot = None
        for _, slot in self._pending.pop(req.request_id, []):
            self.slots.release_snapshot_slot(slot)

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.usable_blocks

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.slots.clear_snapshots()
        self.pool.evicted_hashes()
        self._events.append(AllBlocksCleared())
        return True

    def _flush_evictions(self) -> None:
        evicted = self.pool.evicted_hashes()
        if evicted:
            self._events.append(BlockRemoved(evicted))

    def drain_events(self) -> list[KVEvent]:
        """KV events (vLLM schema) since the last call, in the order the cache changed."""
        self._flush_evictions()
        events, self._events = self._events, []
        return events

    def check_integrity(self, holders: list[Request]) -> None:
        """Raise AssertionError if any block or slot is leaked, double-owned or mis-hashed."""
        refs: dict[int, int] = {}
        for req in holders:
            for b in req.blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)
        slots = [r.kda_slot for r in holders if r.kda_slot is not None]
        if len(slots) != len(set(slots)):
            raise AssertionError(f"a KDA slot is shared by two requests: {slots}")
        pending = sum(len(v) for v in self._pending.values())
        self.slots.check_integrity(set(slots), pending)
