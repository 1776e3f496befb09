"""Base for transports whose tensor bytes bypass the control connection (torch-dist, mooncake).

    receiver                                   sender
                                               publish: tag every tensor under a fresh key of the
                                                 state's own, in a background thread (`StateTags`)
    pull {rid, verify, **_pull_fields()} ───>  acquire lease; _offer() -> extra manifest fields
                                        <───   manifest {..., nonce, key (sealed), **offer}
    _move(): bytes arrive out of band   <───>  _push() (no-op for one-sided reads)
      and are tagged as each tensor lands
    done                                ───>   check lease still valid
                                        <───   end {tags} (the publish-time tags) | error
    compare tags

Tags are GMACs of each tensor's bytes under the state's key, computed once when the state is
published, so a pull's send path has no MAC pass at all (the sender's core is left to the
engine moving the bytes). The key crosses only sealed (AES-GCM) under a key derived from this
connection's session key, and the tags only inside authenticated frames, so bytes moved by a
library that knows nothing of our secret are still authenticated before a pull returns: a peer
without the secret can neither learn the key nor forge a tag, and bytes changed after publish
(in memory or on the wire) no longer match. `verify=False` (only on fabrics that authenticate
themselves, see `TransferConfig`) skips the receiver's tags (and a sender configured so tags
only when a verifying receiver asks). While `_move` runs the receiver watches the control
connection, so a sender that dies is noticed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import struct
import threading
from collections.abc import Awaitable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kv_transfer.client import ControlReceiver, Target, parse_manifest
from kv_transfer.errors import CorruptFrame, error_from_code
from kv_transfer.leases import Lease
from kv_transfer.payload import TransferPayload, byte_view
from kv_transfer.server import ControlSender, HeldState
from kv_transfer.wire import Channel, Gmac

SEAL_CONTEXT = b"kimi-pd kv_transfer v3 sideband state-key seal"
PEER_GRACE_S = 0.5    # how long a failed move waits to learn whether the sender died
PIECE = 8 << 20       # a publish-time tagger stops between pieces when its state is freed
_INDEX = struct.Struct(">I")


class TaggingCancelled(Exception):
    """The state was freed while its publish-time tags were being computed."""


class DataTagger:
    """GMAC tags of one state's tensors under one key; `tag(i)` may run in any thread, once per
    tensor. `cancel()` stops it between pieces and returns only once it reads no tensor."""

    def __init__(self, key: bytes, nonce: object, tensors: list[torch.Tensor]) -> None:
        if not isinstance(nonce, bytes) or len(nonce) != 8:
            raise CorruptFrame("manifest lacks its 8-byte data nonce")
        self._mac = Gmac(key)
        self._nonce = nonce
        self._tensors = tensors
        self._reading = threading.Lock()
        self._cancelled = False
        self.tags: list[bytes | None] = [None] * len(tensors)

    def tag(self, index: int) -> bytes:
        tensor = self._tensors[index]
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        view = byte_view(host)
        mac = self._mac.incremental(self._nonce + _INDEX.pack(index))
        for offset in range(0, max(len(view), 1), PIECE):
            with self._reading:
                if self._cancelled:
                    raise TaggingCancelled
                mac.authenticate_additional_data(view[offset:offset + PIECE])
        mac.finalize()
        self.tags[index] = mac.tag
        return mac.tag

    def all_tags(self) -> list[bytes]:
        """Every tensor's tag, computing those not tagged yet."""
        return [t if t is not None else self.tag(i) for i, t in enumerate(self.tags)]

    def cancel(self) -> None:
        with self._reading:
            self._cancelled = True


class StateTags:
    """A held state's key, nonce and tags: computed once per state (in `executor`), whatever
    the number of pulls, so no pull pays for a MAC pass on the sending side."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.key, self.nonce = os.urandom(32), os.urandom(8)
        self._tagger = DataTagger(self.key, self.nonce, tensors)
        self._future: Future | None = None
        self._lock = threading.Lock()

    def start(self, executor: ThreadPoolExecutor) -> Future:
        """The tags' future, submitting the work on first call (thread-safe)."""
        with self._lock:
            if self._future is None:
                self._future = executor.submit(data_tags, self._tagger)
            return self._future

    def cancel(self) -> None:
        """Stop tagging (the state is freed): returns once no thread reads its tensors."""
        with self._lock:
            if self._future is not None:
                self._future.cancel()
        self._tagger.cancel()


def data_tags(tagger: DataTagger) -> list[bytes]:
    """The sender's tags of a held state (blocking; run in a thread)."""
    return tagger.all_tags()


def seal_key(chan: Channel, key: bytes, rid: str) -> bytes:
    """A state key as it may cross the control connection: AES-GCM under this session's seal
    key, bound to the request id (fresh 12-byte nonce first)."""
    nonce = os.urandom(12)
    return nonce + AESGCM(chan.derived_key(SEAL_CONTEXT)).encrypt(nonce, key, rid.encode())


def unseal_key(chan: Channel, sealed: object, rid: str) -> bytes:
    if not isinstance(sealed, bytes) or len(sealed) != 12 + 32 + 16:
        raise CorruptFrame("manifest lacks the sealed state key")
    try:
        return AESGCM(chan.derived_key(SEAL_CONTEXT)).decrypt(sealed[:12], sealed[12:], rid.encode())
    except InvalidTag as exc:
        raise CorruptFrame("sealed state key does not open under this session") from exc


class SidebandSender(ControlSender):
    """Implements the control flow above; subclasses provide `_offer` and `_push`.

    Tags are computed in one background thread per sender, in publish order, as soon as a state
    is published (when `config.verify_data`; else only once a verifying receiver asks).
    """

    _tagging: ThreadPoolExecutor

    async def start(self) -> None:
        self._tagging = ThreadPoolExecutor(1, thread_name_prefix="kv-publish-tag")
        await super().start()

    async def stop(self) -> None:
        await super().stop()             # frees every lease: each state's tagging is cancelled
        if hasattr(self, "_tagging"):
            self._tagging.shutdown(wait=False, cancel_futures=True)

    def _hold(self, payload: TransferPayload) -> HeldState:
        state = super()._hold(payload)
        state.extra["tags"] = tags = StateTags(state.tensors)
        if self.config.verify_data:
            tags.start(self._tagging)
        return state

    def _drop(self, state: HeldState) -> None:
        state.extra["tags"].cancel()

    async def wait_tagged(self, request_id: str) -> None:
        """Wait until a held state's publish-time tags are computed (benchmarks, tests)."""
        lease = self._leases.acquire(request_id)
        try:
            await asyncio.shield(asyncio.wrap_future(lease.payload.extra["tags"].start(self._tagging)))
        finally:
            self._leases.unacquire(lease)

    async def _offer(self, state: HeldState, request: dict) -> dict:
        """Extra manifest fields for this pull (ranks, addresses, ...); may raise `CorruptFrame`."""
        return {}

    async def _push(self, chan: Channel, state: HeldState, request: dict, offer: dict) -> None:
        """Move the bytes from this side, if the transport needs that (two-sided transports)."""

    async def _serve_pull(self, chan: Channel, lease: Lease, request: dict) -> tuple[int, bool]:
        state: HeldState = lease.payload
        state_tags: StateTags = state.extra["tags"]
        offer = await self._offer(state, request)
        verify = request.get("verify") is not False          # the receiver decides; default: verify
        tags = state_tags.start(self._tagging) if verify else None
        key = seal_key(chan, state_tags.key, state.request_id) if verify else None
        await chan.send(state.manifest(nonce=state_tags.nonce, key=key, **offer))
        async with asyncio.timeout(self.config.transfer_timeout_s):
            await self._push(chan, state, request, offer)
        await chan.recv_message("done", timeout_s=self.config.transfer_timeout_s)
        self._leases.check(lease)
        # shielded: a cancelled pull must not cancel the state's tags, which later pulls reuse
        theirs = None if tags is None else await asyncio.shield(asyncio.wrap_future(tags))
        await chan.send({"t": "end", "tags": theirs})
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
            tagger = None
            if verify:
                key = unseal_key(chan, manifest.get("key"), target.request_id)
                tagger = DataTagger(key, manifest.get("nonce"), tensors)
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
                peer_error = watch.exception() if watch.done() else None
                if peer_error is not None:
                    raise peer_error from job.exception()
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
