"""The Kimi-K3 special-token table, by name, as offsets above the BPE ranks.

The real tokenizer has 163584 BPE ranks and 256 special ids (163584..163839). Generated checkpoints
ship a small BPE with `num_ranks` ranks and put the same 256 names at `num_ranks + offset`, so every
name keeps its relative position and the chat renderer and parsers work on both.
"""
from __future__ import annotations

NUM_SPECIAL_TOKENS = 256

NAMED_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<osagent_mode>": 65,
    "[UNK]": 254,
    "[PAD]": 255,
}


def special_token_table(num_ranks: int) -> dict[str, int]:
    """All 256 special tokens (named ones plus `<|reserved_token_N|>` fillers) -> id."""
    by_offset = {off: name for name, off in NAMED_SPECIAL_OFFSETS.items()}
    return {by_offset.get(i, f"<|reserved_token_{i}|>"): num_ranks + i for i in range(NUM_SPECIAL_TOKENS)}


def special_id(name: str, num_ranks: int) -> int:
    return num_ranks + NAMED_SPECIAL_OFFSETS[name]
