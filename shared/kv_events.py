"""KV-cache events in vLLM's schema, and their msgpack codec.

vLLM encodes each event as a tagged array (`[tag, field, ...]`, msgspec `array_like=True, tag=True`)
inside `KVEventBatch = [ts, [events...], data_parallel_rank]`. We write the same shape so an adapter can
relay a vLLM instance's ZMQ events unchanged, and we read both that shape and plain maps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_FIELDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium")),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _encode_event(event: KVEvent) -> list[Any]:
    tag = type(event).__name__
    return [tag, *(getattr(event, name) for name in _FIELDS[tag][1])]


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag, values = raw[0], dict(zip(_FIELDS.get(raw[0], (None, ()))[1], raw[1:], strict=False))
    else:
        raise ValueError(f"not a KV event: {raw!r}")
    if tag not in _FIELDS:
        raise ValueError(f"unknown KV event type {tag!r}")
    cls, names = _FIELDS[tag]
    return cls(**{k: values[k] for k in names if k in values})


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_encode_event(e) for e in batch.events], batch.data_parallel_rank])


def decode_batch(data: bytes) -> KVEventBatch:
    raw = msgpack.unpackb(data, strict_map_key=False)
    if isinstance(raw, dict):
        return KVEventBatch(raw["ts"], [_decode_event(e) for e in raw["events"]], raw.get("data_parallel_rank"))
    ts, events, *rest = raw
    return KVEventBatch(ts, [_decode_event(e) for e in events], rest[0] if rest else None)
