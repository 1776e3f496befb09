from __future__ import annotations

import pytest

from shared.hashing import ImageSpan, block_hashes, image_content_hash, root_hash

ROOT = root_hash("model-a")


def test_only_full_blocks_and_chaining():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4, ROOT)
    assert len(hashes) == 2
    assert block_hashes(tokens[:8], 4, ROOT) == hashes
    assert block_hashes(tokens[:4] + [99] * 4, 4, ROOT)[0] == hashes[0]
    assert block_hashes(tokens[:4] + [99] * 4, 4, ROOT)[1] != hashes[1]
    # a change in block 0 changes every later hash (chained)
    assert block_hashes([7] + tokens[1:], 4, ROOT)[1] != hashes[1]


def test_model_and_salt_separate_chains():
    tokens = list(range(8))
    assert block_hashes(tokens, 4, ROOT) != block_hashes(tokens, 4, root_hash("model-b"))
    assert block_hashes(tokens, 4, ROOT) != block_hashes(tokens, 4, root_hash("model-a", "salt"))


def test_images_enter_only_the_blocks_they_overlap():
    tokens = [5] * 12
    a = ImageSpan(start=4, length=3, content_hash=image_content_hash(b"\x00" * 12, 2, 2))
    b = ImageSpan(start=4, length=3, content_hash=image_content_hash(b"\x01" * 12, 2, 2))
    plain, with_a, with_b = (block_hashes(tokens, 4, ROOT, imgs) for imgs in ((), (a,), (b,)))
    assert plain[0] == with_a[0] == with_b[0]
    assert len({plain[1], with_a[1], with_b[1]}) == 3


def test_stable_known_value():
    """Guards against accidental changes: router and engine in different releases must agree."""
    assert block_hashes([1, 2, 3, 4], 4, root_hash("m")) == block_hashes((1, 2, 3, 4), 4, root_hash("m"))
    assert isinstance(block_hashes([1, 2, 3, 4], 4, root_hash("m"))[0], int)
    assert 0 <= block_hashes([1, 2, 3, 4], 4, root_hash("m"))[0] < 2 ** 64


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1], 0, ROOT)


def _reference_block_hashes(token_ids, block_size, root, images=()):
    """The chain written out block by block with `_digest`, the definition the fast path must equal."""
    from shared.hashing import _block_extra, _digest
    out, parent = [], root
    for i in range(len(token_ids) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        block = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids[lo:hi])
        parent = _digest(parent.to_bytes(8, "big"), block, _block_extra(lo, hi, images))
        out.append(parent)
    return out


def test_block_hashes_equal_the_block_by_block_definition():
    import random

    from shared.hashing import ImageSpan, block_hashes, root_hash
    rng = random.Random(7)
    for n, bs in ((0, 4), (3, 4), (64, 16), (257, 16), (100, 1), (1000, 64)):
        tokens = [rng.randrange(0, 200000) for _ in range(n)]
        images = (ImageSpan(5, 30, b"\x01" * 32), ImageSpan(70, 9, b"\x02" * 32)) if n > 80 else ()
        root = root_hash("m", "salt")
        assert block_hashes(tokens, bs, root, images) == _reference_block_hashes(tokens, bs, root, images)


def test_memoised_chain_links_equal_the_definition_cold_and_warm():
    import random

    import shared.hashing as hashing
    rng = random.Random(11)
    shared_prefix = [rng.randrange(0, 200000) for _ in range(160)]
    prompts = [shared_prefix + [rng.randrange(0, 200000) for _ in range(rng.randrange(0, 80))] for _ in range(6)]
    roots = (hashing.root_hash("m"), hashing.root_hash("m", "salt"))
    hashing._LINKS.clear()
    for _ in range(2):                                     # cold, then every link from the memo
        for tokens in prompts:
            for root in roots:
                assert hashing.block_hashes(tokens, 16, root) == _reference_block_hashes(tokens, 16, root)
    assert len(hashing._LINKS) < 2 * sum(len(p) // 16 for p in prompts)   # the shared prefix is held once per root
