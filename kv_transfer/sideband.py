"""Base for transports whose tensor bytes bypass the control connection (torch-dist, mooncake).

    receiver                                   sender
    pull {rid, verify, **_pull_fields()} ───>  acquire lease; _offer() -> extra manifest fields
                                        <───   manifest {..., nonce, **offer}
    _move(): bytes arrive out of band   <───>  _push() (no-op for one-sided reads); meanwhile the
      and are tagged as each tensor lands      sender tags its tensors in a thread
    done                                ───>   check lease still valid
                                        <───   end {tags} | error
    compare tags

Tags are GMACs of each tensor's bytes under a key derived from this connection's session key,
with the manifest's fresh nonce, so bytes moved by a library that knows nothing of our secret
are still authenticated before a pull returns, and neither side's hashing waits for the move to
finish. `verify=False` (only on fabrics that authenticate themselves, see `TransferConfig`)
skips the tags on both sides. While `_move` runs the receiver watches the control connection,
so a sender that dies is noticed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import struct
from collections.abc import Awaitable
from typing import Any

import torch

from kv_transfer.client import ControlReceiver, Target, parse_manifest
from kv_transfer.errors import CorruptFrame, error_from_code
from kv_transfer.leases import Lease
from kv_transfer.payload import TransferPayload, byte_view
from kv_transfer.server import ControlSender, HeldState
from kv_transfer.wire import MAX_MAC_INPUT, Channel, Gmac

DATA_CONTEXT = b"kimi-pd kv_transfer v2 sideband data key"
PEER_GRACE_S = 0.5    # how long a failed move waits to learn whether the sender died
_INDEX = struct.Struct(">I")


class DataTagger:
    """GMAC tags of one pull's tensors; `tag(i)` may run in any thread, once per tensor."""

    def __init__(self, chan: Channel, nonce: bytes, tensors: list[torch.Tensor]) -> None:
        if not isinstance(nonce, bytes) or len(nonce) != 8:
            raise CorruptFrame("manifest lacks its 8-byte data nonce")
        self._mac = Gmac(chan.derived_key(DATA_CONTEXT))
        self._nonce = nonce
        self._tensors = tensors
        self.tags: list[bytes | None] = [None] * len(tensors)

    def tag(self, index: int) -> bytes:
        tensor = self._tensors[index]
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        view = byte_view(host)
        mac = self._mac.incremental(self._nonce + _INDEX.pack(index))
        for offset in range(0, len(view), MAX_MAC_INPUT):
            mac.authenticate_additional_data(view[offset:offset + MAX_MAC_INPUT])
        mac.finalize()
        self.tags[index] = mac.tag
        return mac.tag

    def all_tags(self) -> list[bytes]:
        """Every tensor's tag, computing those not tagged yet."""
        return [t if t is not None else self.tag(i) for i, t in enumerate(self.tags)]


def data_tags(tagger: DataTagger) -> list[bytes]:
    """The sender's tags of a held state (blocking; run in a thread)."""
    return tagger.all_tags()


class SidebandSender(ControlSender):
    """Implements the control flow above; subclasses provide `_offer` and `_push`."""

    async def _offer(self, state: HeldState, request: dict) -> dict:
        """Extra manifest fields for this pull (ranks, addresses, ...); may raise `CorruptFrame`."""
        return {}

    async def _push(self, chan: Channel, state: HeldState, request: dict, offer: dict) -> None:
        """Move the bytes from this side, if the transport needs that (two-sided transports)."""

    async def _serve_pull(self, chan: Channel, lease: Lease, request: dict) -> tuple[int, bool]:
        state: HeldState = lease.payload
        offer = await self._offer(state, request)
        nonce = os.urandom(8)
        await chan.send(state.manifest(nonce=nonce, **offer))
        tags = None
        if request.get("verify") is not False:             # the receiver decides; default: verify
            tagger = DataTagger(chan, nonce, state.tensors)
            tags = asyncio.ensure_future(asyncio.to_thread(data_tags, tagger))
        try:
            async with asyncio.timeout(self.config.transfer_timeout_s):
                await self._push(chan, state, request, offer)
            await chan.recv_message("done", timeout_s=self.config.transfer_timeout_s)
            self._leases.check(lease)
            await chan.send({"t": "end", "tags": None if tags is None else await tags})
        finally:
            if tags is not None and not tags.done():
                await asyncio.gather(tags, return_exceptions=True)   # it reads the tensors
        return state.nbytes, True


class SidebandReceiver(ControlReceiver):
    """Implements the control flow above; subclasses provide `_pull_fields` and `_move`."""

    def _pull_fields(self) -> dict[str, Any]:
        return {}

    def _allocate(self, specs) -> list[torch.Tensor]:
        if torch.device(self.config.device).type == "cpu":
            return self._host_tensors(specs)
        return [spec.empty(self.config.device) for spec in specs]

    async def _move(self, chan: Channel, manifest: dict, tensors: list[torch.Tensor],
                    tagger: DataTagger | None) -> None:
        """Fill `tensors` (preallocated on `config.device`) with the sender's bytes, calling
        `tagger.tag(i)` (from any thread) as soon as tensor i is complete, if a tagger is given.

        May send frames on `chan` (never read: the caller is reading it concurrently)."""
        raise NotImplementedError

    async def _fetch(self, target: Target) -> TransferPayload:
        chan = await self._connect(target)
        verify = self.config.verify_data
        try:
            await chan.send({"t": "pull", "rid": target.request_id, "verify": verify,
                             **self._pull_fields()})
            manifest = await chan.recv()
            if manifest.get("t") == "error":
                raise error_from_code(manifest.get("code"), manifest.get("msg"))
            meta, specs = parse_manifest(manifest, target.request_id, self.config.max_state_bytes)
            tensors = self._allocate(specs)
            tagger = DataTagger(chan, manifest.get("nonce"), tensors) if verify else None
            watch = await self._guarded(chan, self._move(chan, manifest, tensors, tagger))
            try:
                ours = await asyncio.to_thread(tagger.all_tags) if tagger else None
                await chan.send({"t": "done"})
                end = _expect_end(await watch)
                if ours is not None:
                    theirs = end.get("tags")
                    if not isinstance(theirs, list) or len(theirs) != len(ours) or not all(
                            isinstance(t, bytes) and hmac.compare_digest(t, o)
                            for t, o in zip(theirs, ours, strict=True)):
                        raise CorruptFrame("tensor bytes do not match the sender's tags")
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            named = {spec.name: t for spec, t in zip(specs, tensors, strict=True)}
            return TransferPayload(target.request_id, meta, named)
        finally:
            chan.close()

    async def _guarded(self, chan: Channel, work: Awaitable[None]) -> asyncio.Task:
        """Await `work` while reading `chan`; returns the still-pending read (the final frame).

        If the peer closes, errs or sends anything before `work` finishes, that wins and `work`
        is cancelled (a blocking call in a thread runs on to its own timeout, its result dropped).
        """
        watch = asyncio.ensure_future(chan.recv(self.config.transfer_timeout_s))
        job = asyncio.ensure_future(work)
        try:
            await asyncio.wait({watch, job}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                _expect_end(watch.result())
                raise CorruptFrame("sender ended the transfer before the data arrived")
            if job.exception() is not None:
                # A move usually fails because the sender died: its control connection then
                # closes at the same moment, and that (PeerClosed) is the error to report.
                await asyncio.wait({watch}, timeout=PEER_GRACE_S)
                if watch.done() and watch.exception() is not None:
                    raise watch.exception() from job.exception()
            job.result()
            return watch
        except BaseException:
            watch.cancel()
            job.cancel()
            await asyncio.gather(watch, job, return_exceptions=True)
            raise


def _expect_end(header: dict) -> dict:
    if header.get("t") == "error":
        raise error_from_code(header.get("code"), header.get("msg"))
    if header.get("t") != "end" or header["n"]:
        raise CorruptFrame(f"expected 'end', got {header.get('t')!r}")
    return header
