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


def padded_rows(batch: int, bucket: int) -> range:
    """Rows of a padded batch that are padding (their outputs are discarded)."""
    if bucket < batch:
        raise ValueError(f"bucket {bucket} smaller than the batch {batch}")
    return range(batch, bucket)
