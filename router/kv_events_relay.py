"""vLLM's ZMQ KV-cache events into the router's exact prefix index (`--kv-events URL=ENDPOINT`).

A stock vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:5557"}'` publishes every block it stores or evicts as multipart
messages `(topic, seq: 8 bytes big-endian, payload)`, the payload a msgpack `KVEventBatch` in the
schema `shared.kv_events` already decodes (vLLM's `vllm/distributed/kv_events.py`).

vLLM's block hashes are its own (sha256 over its own chain, seeded per process), so the router
cannot look them up with prompt hashes of its own. `BlockStored` carries the blocks' token ids,
though: the relay rehashes them with the router's chain (`shared.hashing.block_hashes`, the same
root and block size placement uses for that worker) and keeps vLLM hash -> our hash, so that a
child block chains from its parent and `BlockRemoved` can drop what it stored. LoRA and
multimodal extra keys are not reproduced: such blocks simply never match a prompt.

A gap in sequence numbers (a restarted vLLM, a dropped message at the high-water mark) means the
relay's view is incomplete: it starts the worker's exact entry afresh from the next events.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from router.placement.prefix_index import PrefixIndex
from shared.hashing import block_hashes
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, decode_batch

log = logging.getLogger(__name__)


@dataclass
class Translator:
    """vLLM's events for one worker -> the same events over the router's block hashes."""

    root: int
    block_size: int
    ours: dict = field(default_factory=dict)          # vLLM block hash -> our block hash

    def translate(self, batch: KVEventBatch) -> KVEventBatch:
        out: list[KVEvent] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, BlockRemoved):
                hashes = [self.ours.pop(h) for h in event.block_hashes if h in self.ours]
                if hashes:
                    out.append(BlockRemoved(hashes, event.medium))
            elif isinstance(event, AllBlocksCleared):
                self.ours.clear()
                out.append(event)
        return KVEventBatch(batch.ts, out, batch.data_parallel_rank)

    def _stored(self, event: BlockStored) -> BlockStored | None:
        if event.block_size != self.block_size or event.lora_id:
            return None                                   # not a block placement can match (other size, LoRA)
        if event.parent_block_hash is None:
            parent = self.root
        elif event.parent_block_hash in self.ours:
            parent = self.ours[event.parent_block_hash]
        else:
            return None                                   # its parent was stored before we listened
        ours = block_hashes(event.token_ids, self.block_size, parent)
        if len(ours) != len(event.block_hashes):
            return None
        self.ours.update(zip(event.block_hashes, ours, strict=False))
        return BlockStored(ours, None if event.parent_block_hash is None else parent, event.token_ids,
                           event.block_size)


def parse_kv_events_flag(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`URL=tcp://HOST:PORT` items -> ((worker url, ZMQ endpoint), ...)."""
    out = []
    for value in values:
        url, sep, endpoint = value.partition("=")
        if not sep or not url.startswith(("http://", "https://")) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-events {value!r}: give WORKER_URL=tcp://HOST:PORT")
        out.append((url, endpoint))
    return tuple(out)


class KVEventsRelay:
    """One SUB socket per worker; events go into `index` as that worker's exact entry."""

    def __init__(self, endpoints: tuple[tuple[str, str], ...], index: PrefixIndex, exact_workers: set[str],
                 chain_of: Callable[[str], tuple[int, int]], topic: str = "") -> None:
        self.endpoints, self.index, self.exact_workers = endpoints, index, exact_workers
        self.chain_of, self.topic = chain_of, topic
        self.batches = 0
        self.gaps = 0

    def apply(self, worker_id: str, translator: Translator, seq: int, last: int | None, payload: bytes) -> int:
        """Apply one message; returns its sequence number (the next `last`)."""
        if last is not None and seq != last + 1:
            self.gaps += 1
            log.warning("KV events of %s: gap after %d (got %d); its exact index starts afresh", worker_id, last, seq)
            translator.ours.clear()
            self.index.drop_worker(worker_id)
        batch = translator.translate(decode_batch(payload))
        self.index.apply(worker_id, batch)
        self.exact_workers.add(worker_id)
        self.batches += 1
        return seq

    async def run(self, stop: asyncio.Event) -> None:
        import zmq
        import zmq.asyncio
        context = zmq.asyncio.Context()
        try:
            await asyncio.gather(*(self._follow(context, url, endpoint, stop) for url, endpoint in self.endpoints))
        finally:
            context.destroy(linger=0)

    async def _follow(self, context, worker_id: str, endpoint: str, stop: asyncio.Event) -> None:
        import zmq
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        root, block_size = self.chain_of(worker_id)
        translator, last = Translator(root, block_size), None
        log.info("following KV events of %s at %s", worker_id, endpoint)
        try:
            while not stop.is_set():
                if not await sock.poll(timeout=500):
                    continue
                parts = await sock.recv_multipart()
                if len(parts) != 3:
                    continue
                try:
                    last = self.apply(worker_id, translator, int.from_bytes(parts[1], "big"), last, parts[2])
                except Exception:                          # noqa: BLE001 - a bad message must not end the relay
                    log.exception("bad KV event batch from %s", worker_id)
        finally:
            sock.close(linger=0)
