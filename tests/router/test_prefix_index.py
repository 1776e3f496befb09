from __future__ import annotations

import random

import pytest

from router.placement import ApproximatePrefixIndex, PrefixIndex
from shared.hashing import block_hashes, root_hash
from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

H = [1000 + i for i in range(8)]        # a prompt's chained block hashes, block 0 first


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [], 4)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(list(hashes))


@pytest.mark.parametrize("events,expected", [
    ([stored(*H[:4])], 4),
    ([stored(*H[:4]), removed(H[3])], 3),
    ([stored(*H[:4]), removed(H[1])], 1),                    # mid-chain removal stops the match
    ([stored(*H[:4]), removed(H[0])], 0),
    ([stored(*H[1:4])], 0),                                  # no block 0: nothing reusable
    ([stored(*H[:2]), stored(*H[2:5])], 5),
    ([stored(*H[:4]), AllBlocksCleared()], 0),
    ([stored(*H[:4]), AllBlocksCleared(), stored(H[0])], 1),
    ([removed(H[0]), stored(*H[:2])], 2),                    # order matters: removal came first
    ([stored(*H[:2]), removed(H[0]), stored(H[0])], 2),
    ([stored(*H)], 6),                                       # capped by the query's 6 blocks
])
def test_events_applied_in_order(events, expected):
    index = PrefixIndex()
    index.apply("w", KVEventBatch(0.0, events))
    assert index.matched_blocks("w", H[:6]) == expected


def test_workers_are_independent_and_droppable():
    index = PrefixIndex()
    index.apply("a", KVEventBatch(0.0, [stored(*H[:3])]))
    index.apply("b", KVEventBatch(0.0, [stored(H[0])]))
    index.apply("b", KVEventBatch(1.0, [AllBlocksCleared()]))
    assert (index.matched_blocks("a", H), index.matched_blocks("b", H)) == (3, 0)
    index.drop_worker("a")
    assert index.matched_blocks("a", H) == 0 and index.num_blocks("a") == 0
    assert index.matched_blocks("never-seen", H) == 0 and index.matched_blocks("a", []) == 0


def test_engine_hashes_through_the_wire_codec():
    """Events as the engine publishes them (shared.hashing, msgpack) match the router's own hashes."""
    root = root_hash("m")
    conversation = list(range(40))
    engine_hashes = block_hashes(conversation[:24], 8, root)      # turn 1 cached on the worker
    wire = encode_batch(KVEventBatch(1.0, [BlockStored(engine_hashes, None, conversation[:24], 8)]))
    index = PrefixIndex()
    index.apply("w", decode_batch(wire))
    assert index.matched_blocks("w", block_hashes(conversation, 8, root)) == 3
    assert index.matched_blocks("w", block_hashes(conversation, 8, root_hash("m", "salt"))) == 0


def random_batches(seed: int, n: int) -> list[KVEventBatch]:
    rng, pool = random.Random(seed), list(range(1, 41))
    def event():
        kind = rng.choices(["stored", "removed", "cleared"], weights=[6, 4, 1])[0]
        if kind == "cleared":
            return AllBlocksCleared()
        picked = rng.sample(pool, rng.randint(1, 6))
        return stored(*picked) if kind == "stored" else removed(*picked)
    return [KVEventBatch(float(i), [event() for _ in range(rng.randint(1, 4))]) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapshot_plus_later_events_equals_full_replay(seed):
    batches = random_batches(seed, 60)
    full = PrefixIndex()
    for b in batches:
        full.apply("w", b)
    assert full.num_blocks("w") > 0
    for split in range(0, len(batches) + 1, 7):
        prefix = PrefixIndex()
        for b in batches[:split]:
            prefix.apply("w", b)
        late = PrefixIndex()
        late.apply("w", KVEventBatch(0.0, [stored(999)]))       # stale state a snapshot must replace
        late.load_snapshot("w", prefix.blocks("w"))
        for b in batches[split:]:
            late.apply("w", b)
        assert late.blocks("w") == full.blocks("w")


def test_apply_rejects_non_events():
    with pytest.raises(TypeError):
        PrefixIndex().apply("w", KVEventBatch(0.0, ["BlockStored"]))  # type: ignore[list-item]


# ---------------------------------------------------------------------------------- approximate index
A, B, C = [10, 11, 12], [20, 21, 22], [30, 31, 32]


def test_approximate_records_what_was_sent():
    index = ApproximatePrefixIndex(capacity_blocks=100)
    index.record("w", A)
    assert index.matched_blocks("w", A + [13]) == 3
    assert index.matched_blocks("w", [10, 99, 12]) == 1
    assert index.matched_blocks("other", A) == 0


@pytest.mark.parametrize("capacity,sent,query,expected", [
    (5, [A, B], A, 2),         # 6 blocks into 5: A's tail (oldest) goes, its head stays
    (5, [A, B], B, 3),
    (6, [A, B, C], A, 0),      # A was least recent: all of it goes
    (6, [A, B, C], B, 3),
    (6, [A, B, A, C], A, 3),   # re-sending A made it recent, so B went instead
    (6, [A, B, A, C], B, 0),
    (6, [A, B, A, C], C, 3),
    (5, [A, B, A, C], A, 2),   # C takes 3 of 5 blocks; A keeps its 2 most recent: blocks 0 and 1
    (5, [list(range(50, 58))], list(range(50, 58)), 5),   # longer than capacity: the head survives
])
def test_approximate_lru_bound(capacity, sent, query, expected):
    index = ApproximatePrefixIndex(capacity_blocks=capacity)
    for prompt in sent:
        index.record("w", prompt)
        assert index.num_blocks("w") <= capacity
    assert index.matched_blocks("w", query) == expected


@pytest.mark.parametrize("seed", range(6))
def test_recording_many_prompts_at_once_leaves_what_recording_each_leaves(seed):
    rng = random.Random(seed)
    for _ in range(50):
        capacity = rng.randint(1, 30)
        one, many = ApproximatePrefixIndex(capacity), ApproximatePrefixIndex(capacity)
        shared_head = [rng.randint(0, 40) for _ in range(rng.randint(0, 6))]
        before = [[rng.randint(0, 40) for _ in range(rng.randint(1, 10))] for _ in range(rng.randint(0, 4))]
        batch = [shared_head + [rng.randint(0, 40) for _ in range(rng.randint(0, 8))]
                 for _ in range(rng.randint(1, 8))]
        for prompt in before:
            one.record("w", prompt)
            many.record("w", prompt)
        for prompt in batch:
            one.record("w", prompt)
        many.record_many("w", batch)
        assert one.num_blocks("w") == many.num_blocks("w") <= capacity
        for prompt in before + batch:                 # every prefix of every prompt: same hits
            for end in range(len(prompt) + 1):
                assert one.matched_blocks("w", prompt[:end]) == many.matched_blocks("w", prompt[:end])
        one.record("w", [99, 98])                     # and the same order of recency: the same evictions next
        many.record("w", [99, 98])
        prompts = before + batch
        assert [one.matched_blocks("w", p) for p in prompts] == [many.matched_blocks("w", p) for p in prompts]


def test_approximate_queries_do_not_refresh_recency():
    index = ApproximatePrefixIndex(capacity_blocks=6)
    index.record("w", A)
    index.record("w", B)
    index.matched_blocks("w", A)
    index.record("w", C)
    assert (index.matched_blocks("w", A), index.matched_blocks("w", B)) == (0, 3)


def test_approximate_capacity_must_be_positive():
    with pytest.raises(ValueError):
        ApproximatePrefixIndex(capacity_blocks=0)
    index = ApproximatePrefixIndex(capacity_blocks=2)
    index.record("w", A)
    index.drop_worker("w")
    assert index.num_blocks("w") == 0
