"""KDA state slots: one working slot per running sequence, plus prefix-cache snapshots.

A snapshot is the KDA (conv + recurrent) state after a block boundary, keyed by the hash of the
block that ends there: the chained hash names the whole prefix, so a hit on that hash plus the MLA
blocks before it resumes a sequence exactly. Snapshots are evicted LRU when a slot is needed.
"""
from __future__ import annotations

from collections import OrderedDict


class StateSlotPool:
    def __init__(self, num_working: int, num_snapshot: int) -> None:
        self.free_working = list(range(num_working - 1, -1, -1))
        self.num_working = num_working
        snapshot_ids = range(num_working, num_working + num_snapshot)
        self.free_snapshot = list(reversed(snapshot_ids))
        self.snapshot_by_hash: OrderedDict[int, int] = OrderedDict()     # LRU order
        self.num_slots = num_working + num_snapshot

    # ---- working slots ------------------------------------------------------------------------
    @property
    def num_free_working(self) -> int:
        return len(self.free_working)

    def take_working(self) -> int:
        if not self.free_working:
            raise MemoryError("no free KDA state slot")
        return self.free_working.pop()

    def release_working(self, slot: int) -> None:
        if slot in self.free_working or not 0 <= slot < self.num_working:
            raise RuntimeError(f"working slot {slot} released twice or out of range")
        self.free_working.append(slot)

    # ---- snapshots ----------------------------------------------------------------------------
    def snapshot_for(self, block_hash: int) -> int | None:
        slot = self.snapshot_by_hash.get(block_hash)
        if slot is not None:
            self.snapshot_by_hash.move_to_end(block_hash)
        return slot

    def reserve_snapshot(self, block_hash: int) -> int | None:
        """A slot to write the snapshot for `block_hash` into (evicting the LRU one); None if cached or full.

        The slot is pending until `commit_snapshot`: a snapshot becomes visible only after the forward
        pass that writes it, so nothing can read a slot before it is filled.
        """
        if block_hash in self.snapshot_by_hash:
            return None
        if self.free_snapshot:
            return self.free_snapshot.pop()
        if self.snapshot_by_hash:
            return self.snapshot_by_hash.popitem(last=False)[1]
        return None

    def commit_snapshot(self, block_hash: int, slot: int) -> None:
        if block_hash in self.snapshot_by_hash:          # another sequence published it first
            self.free_snapshot.append(slot)
        else:
            self.snapshot_by_hash[block_hash] = slot

    def release_snapshot_slot(self, slot: int) -> None:
        """Give back a reserved slot whose snapshot was never written (request aborted mid-step)."""
        self.free_snapshot.append(slot)

    def forget_snapshot(self, block_hash: int) -> None:
        slot = self.snapshot_by_hash.pop(block_hash, None)
        if slot is not None:
            self.free_snapshot.append(slot)

    def clear_snapshots(self) -> None:
        for h in list(self.snapshot_by_hash):
            self.forget_snapshot(h)

    def check_integrity(self, working_in_use: set[int], pending_snapshots: int = 0) -> None:
        free = set(self.free_working)
        if free & working_in_use or len(free) + len(working_in_use) != self.num_working:
            raise AssertionError(f"working slots: free {sorted(free)}, in use {sorted(working_in_use)}")
        snaps = set(self.snapshot_by_hash.values())
        if snaps & set(self.free_snapshot) or len(snaps) != len(self.snapshot_by_hash):
            raise AssertionError("snapshot slot both free and used, or used twice")
        total = len(snaps) + len(set(self.free_snapshot)) + pending_snapshots
        if total != self.num_slots - self.num_working or len(set(self.free_snapshot)) != len(self.free_snapshot):
            raise AssertionError(f"snapshot slots leaked: {total} accounted of {self.num_slots - self.num_working}")
