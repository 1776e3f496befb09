"""Chained prefix-block hashes, shared by the engine's prefix cache and the router's prefix index.

    h_root = H("kimi-pd/v1", model_id, cache_salt)
    h_i    = H(h_{i-1}, token ids of block i, images overlapping block i)

Only full blocks are hashed. An image contributes (content hash, absolute start, length) to every
block its placeholder run overlaps, so two prompts with equal token ids but different pixels never
share a block. Hashes are unsigned 64-bit ints (blake2b-8), the form vLLM's KV events carry.
Both sides must call exactly these functions: the router's index is only exact if it agrees bit for bit.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HASH_VERSION = "kimi-pd/v1"
# (parent hash, block token ids) -> block hash, for image-free blocks: prompts share prefixes, and
# the router hashes every prompt it places. Exact (the key is the hash's whole input); bounded.
_LINKS: dict[tuple[int, tuple[int, ...]], int] = {}
MAX_LINKS = 16384


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder run in the prompt: tokens [start, start + length) and its content hash."""

    start: int
    length: int
    content_hash: bytes


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return int.from_bytes(h.digest(), "big")


def root_hash(model_id: str, cache_salt: str | None = None) -> int:
    """The chain's parent for block 0: different models or salts never share blocks."""
    return _digest(HASH_VERSION.encode(), model_id.encode(), (cache_salt or "").encode())


def salted_root(root: int, cache_salt: str | None) -> int:
    """vLLM's `cache_salt`: a request's chain starts from its salt, so only requests with the same
    salt share cached blocks (router and engine derive it the same way)."""
    return root if not cache_salt else _digest(root.to_bytes(8, "big"), b"cache_salt", cache_salt.encode())


def image_content_hash(rgb_bytes: bytes, width: int, height: int) -> bytes:
    """Hash of an image's decoded RGB pixels (not its file encoding), so router and engine agree."""
    return hashlib.sha256(struct.pack("<II", width, height) + rgb_bytes).digest()


def _block_extra(lo: int, hi: int, images: Sequence[ImageSpan]) -> bytes:
    parts = [struct.pack("<II", img.start, img.length) + img.content_hash
             for img in images if img.start < hi and img.start + img.length > lo]
    return b"".join(parts)


def block_hashes(token_ids: Sequence[int], block_size: int, root: int,
                 images: Sequence[ImageSpan] = ()) -> list[int]:
    """Hashes of every FULL block of `token_ids`, chained from `root`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    step = block_size * 8
    block_len, parent_len, no_extra = struct.pack("<I", step), struct.pack("<I", 8), struct.pack("<I", 0)
    out, parent = [], root
    blake2b = hashlib.blake2b
    if not images:
        # the common case: no pixels to mix in, so a chain link is memoisable, keyed by the block's
        # ids (a tuple slice: a hit never converts the ids to bytes, and prompts share prefixes)
        memo, pack = _LINKS, struct.Struct(f"<{block_size}q").pack
        for lo in range(0, len(token_ids) - block_size + 1, block_size):
            block = tuple(token_ids[lo:lo + block_size])
            link = memo.get((parent, block))
            if link is None:
                message = b"".join((parent_len, parent.to_bytes(8, "big"), block_len, pack(*block), no_extra))
                link = int.from_bytes(blake2b(message, digest_size=8).digest(), "big")
                if len(memo) >= MAX_LINKS:
                    memo.clear()
                memo[(parent, block)] = link
            out.append(link)
            parent = link
        return out
    # the same bytes `_digest` would frame, built once per prompt
    data = np.asarray(token_ids, dtype=np.int64).astype("<i8", copy=False).tobytes()
    for i in range(len(data) // step):
        extra = _block_extra(i * block_size, (i + 1) * block_size, images)
        tail = struct.pack("<I", len(extra)) + extra if extra else no_extra
        # one-shot over the framed parts: equal to feeding them one by one, at a third of the calls
        message = b"".join((parent_len, parent.to_bytes(8, "big"), block_len, data[i * step:(i + 1) * step], tail))
        parent = int.from_bytes(blake2b(message, digest_size=8).digest(), "big")
        out.append(parent)
    return out
