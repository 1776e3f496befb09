"""Batch-size buckets and padding: pure functions, so the policy is tested without a device.

A decode step with B sequences replays the graph of the smallest captured size >= B; the extra
rows are padding sequences that write only to a scratch page and a scratch KDA slot, and their
logits are dropped. Batches larger than the largest bucket run eager.
"""
from __future__ import annotations


def capture_sizes(max_num_seqs: int, configured: tuple[int, ...] | None = None,
                  max_size: int | None = None) -> tuple[int, ...]:
    """vLLM's default ladder (1, 2, 4, 8, 16, 24, ...), cut at the largest batch this engine runs."""
    top = min(max_num_seqs, max_size or max_num_seqs)
    ladder = configured or (1, 2, 4) + tuple(range(8, top + 8, 8))
    sizes = tuple(sorted({s for s in ladder if s <= top}))
    return sizes or (top,)


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size holding `batch` sequences; None when it exceeds every bucket."""
    for size in sizes:
        if size >= batch:
            return size
    return None


def context_ladder(max_blocks: int, first: int = 8) -> tuple[int, ...]:
    """Block-table widths a decode graph is captured for: first, 2*first, ... doubling, then max_blocks.

    A step attends (masked) over its bucket's whole width, so widths double: at most 2x the real
    longest context, and log2(max_blocks / first) + 1 graphs per batch size.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    widths, width = [], max(1, first)
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return (*widths, max_blocks)


def context_bucket(blocks: int, widths: tuple[int, ...]) -> int | None:
    """The narrowest width holding `blocks` pages; None when it exceeds every width."""
    return bucket_for(blocks, widths)
