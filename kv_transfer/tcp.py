"""`tcp` transport (the default): tensor bytes travel as authenticated chunk frames on the control
connections themselves, spread over several parallel connections ("streams").

A pull of S streams opens S connections; stream s asks for its share of a plan both sides derive
from the manifest, `chunk_plan(specs, chunk_bytes, S)[s]`, so every chunk frame is checked
against exactly one expected (tensor, offset, length) and written straight into its destination:

    stream s:  pull{rid, stream=s, streams=S, chunk}  ->  manifest, chunk*, end | error

Each stream's data phase runs in a thread of its own on both sides (`wire.in_thread`): the
sender MACs each piece of a chunk as it sends it with blocking `sendall`; the receiver reads it
with `recv_into(MSG_WAITALL)` straight into the destination tensor's memory and MACs it there,
while it is still in cache (`kv_transfer.wire`). Streams overlap one another's hashing and I/O.
The pull succeeds only when every stream delivered every planned chunk (verified) and its `end`;
the sender sends `end` only while the lease is still valid.
"""

from __future__ import annotations

import functools
import math

from kv_transfer.client import ControlReceiver, Target, gather_all, parse_manifest
from kv_transfer.errors import CorruptFrame, error_from_code
from kv_transfer.leases import Lease
from kv_transfer.payload import TensorSpec, TransferPayload, byte_view
from kv_transfer.server import ControlSender, HeldState
from kv_transfer.wire import Channel, in_thread

Chunk = tuple[int, int, int]  # (tensor index, byte offset, byte length)


def send_chunk(chan: Channel, header: dict, body: memoryview) -> None:
    """Send one chunk frame, MAC'd as it goes (in the stream's thread; tests wrap this)."""
    chan.send_blocking(header, body)


def chunk_plan(specs: list[TensorSpec], chunk_bytes: int, streams: int) -> list[list[Chunk]]:
    """Split every tensor into chunks of at most `chunk_bytes`; give each, in order, to the stream
    with the fewest bytes so far (ties: lowest index). Deterministic, so both sides agree."""
    plan: list[list[Chunk]] = [[] for _ in range(streams)]
    load = [0] * streams
    for index, spec in enumerate(specs):
        for offset in range(0, spec.nbytes, chunk_bytes):
            length = min(chunk_bytes, spec.nbytes - offset)
            s = load.index(min(load))
            plan[s].append((index, offset, length))
            load[s] += length
    return plan


def _pull_shape(request: dict) -> tuple[int, int, int]:
    stream, streams, chunk = (request.get(k) for k in ("stream", "streams", "chunk"))
    if not (isinstance(stream, int) and isinstance(streams, int) and isinstance(chunk, int)) or not (
        1 <= streams <= 64 and 0 <= stream < streams and 64 << 10 <= chunk <= 256 << 20
    ):
        raise CorruptFrame("bad pull request (stream, streams or chunk out of range)")
    return stream, streams, chunk


class TcpSender(ControlSender):
    """Serves each stream of a pull its planned chunks."""

    transport_name = "tcp"

    def _hold(self, payload: TransferPayload) -> HeldState:
        state = super()._hold(payload)
        state.extra["views"] = [byte_view(t) for t in state.tensors]
        return state

    async def _serve_pull(self, chan: Channel, lease: Lease, request: dict) -> tuple[int, bool]:
        stream, streams, chunk = _pull_shape(request)
        state: HeldState = lease.payload
        share = chunk_plan(state.specs, chunk, streams)[stream]
        await chan.send(state.manifest())
        await in_thread(chan, lambda: self._send_share(chan, lease, state, share))
        return sum(length for *_, length in share), stream == 0

    def _send_share(self, chan: Channel, lease: Lease, state: HeldState, share: list[Chunk]) -> None:
        """Blocking: tag and send every chunk of `share`, then `end` (in the stream's thread)."""
        views, specs = state.extra["views"], state.specs
        for index, offset, length in share:
            spec = specs[index]
            self._leases.check(lease)
            header = {"t": "chunk", "rid": state.request_id, "name": spec.name, "i": index,
                      "dtype": spec.dtype, "shape": list(spec.shape), "off": offset}
            send_chunk(chan, header, views[index][offset:offset + length])
        self._leases.check(lease)
        chan.send_blocking({"t": "end"})


class TcpReceiver(ControlReceiver):
    """Pulls over `min(streams, ceil(state_bytes / chunk_bytes))` parallel connections."""

    transport_name = "tcp"

    async def _fetch(self, target: Target) -> TransferPayload:
        count = self._stream_count(target)
        chans = await gather_all([self._connect(target) for _ in range(count)], Channel.close)
        try:
            return await self._fetch_on(chans, target)
        finally:
            for chan in chans:
                chan.close()

    def _stream_count(self, target: Target) -> int:
        if not target.state_bytes:
            return self.config.streams
        return max(1, min(self.config.streams, math.ceil(target.state_bytes / self.config.chunk_bytes)))

    async def _fetch_on(self, chans: list[Channel], target: Target) -> TransferPayload:
        rid, chunk = target.request_id, self.config.chunk_bytes
        for stream, chan in enumerate(chans):
            await chan.send({"t": "pull", "rid": rid, "stream": stream, "streams": len(chans),
                             "chunk": chunk})
        headers = await gather_all([chan.recv() for chan in chans])
        for header in headers:
            if header.get("t") == "error":
                raise error_from_code(header.get("code"), header.get("msg"))
        meta, specs = parse_manifest(headers[0], rid, self.config.max_state_bytes)
        if any(h != headers[0] for h in headers[1:]):
            raise CorruptFrame("streams disagree on the manifest")
        tensors = self._host_tensors(specs)
        views = [byte_view(t) for t in tensors]
        plan = chunk_plan(specs, chunk, len(chans))
        await gather_all([
            in_thread(chan, functools.partial(_recv_share, chan, rid, specs, views, share))
            for chan, share in zip(chans, plan, strict=True)
        ])
        return TransferPayload(rid, meta, {s.name: t for s, t in zip(specs, tensors, strict=True)})


def _recv_share(chan: Channel, rid: str, specs: list[TensorSpec], views: list[memoryview],
                share: list[Chunk]) -> None:
    """Blocking, in the stream's thread: receive exactly `share`, in order, each chunk straight
    into its destination and verified before the next, then `end`; anything else is an error."""
    for index, offset, length in share:
        header = chan.recv_blocking()
        if header.get("t") == "error":
            raise error_from_code(header.get("code"), header.get("msg"))
        spec = specs[index]
        got = tuple(header.get(k) for k in ("t", "rid", "i", "name", "dtype", "shape", "off", "n"))
        want = ("chunk", rid, index, spec.name, spec.dtype, list(spec.shape), offset, length)
        if got != want:
            raise CorruptFrame(f"unexpected chunk frame for {spec.name!r} at offset {offset}")
        chan.recv_body_blocking(views[index][offset:offset + length])
    chan.recv_message_blocking("end")
