"""Base for transports whose tensor bytes bypass the control connection (torch-dist, mooncake).

    receiver                                   sender
    pull {rid, **_pull_fields()}        ───>   acquire lease; _offer() -> extra manifest fields
                                        <───   manifest {..., digests, **offer}
    _move(): bytes arrive out of band   <───>  _push() (no-op for one-sided reads)
    verify SHA-256 of every tensor;
    done                                ───>   check lease still valid
                                        <───   end | error

The per-tensor digests travel in the authenticated manifest, so bytes moved by a library that
knows nothing of our secret are still verified before a pull returns. While `_move` runs the
receiver watches the control connection, so a sender that dies is noticed at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable
from typing import Any

import torch

from kv_transfer.client import ControlReceiver, Target, parse_manifest
from kv_transfer.errors import CorruptFrame, error_from_code
from kv_transfer.leases import Lease
from kv_transfer.payload import TransferPayload, byte_view
from kv_transfer.server import ControlSender, HeldState
from kv_transfer.wire import Channel


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    return hashlib.sha256(byte_view(tensor if tensor.device.type == "cpu" else tensor.cpu())).digest()


async def tensor_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """SHA-256 of each tensor's bytes (device tensors are copied to host first), hashed in the
    loop's thread pool in parallel (hashlib releases the GIL)."""
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(None, _tensor_digest, t) for t in tensors)))


async def state_digests(state: HeldState) -> list[bytes]:
    """Digests of a held state, computed once and cached on it."""
    if "digests" not in state.extra:
        state.extra["digests"] = await tensor_digests(state.tensors)
    return state.extra["digests"]


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
        await chan.send(state.manifest(digests=await state_digests(state), **offer))
        async with asyncio.timeout(self.config.transfer_timeout_s):
            await self._push(chan, state, request, offer)
        await chan.recv_message("done", timeout_s=self.config.transfer_timeout_s)
        self._leases.check(lease)
        await chan.send({"t": "end"})
        return state.nbytes, True


class SidebandReceiver(ControlReceiver):
    """Implements the control flow above; subclasses provide `_pull_fields` and `_move`."""

    def _pull_fields(self) -> dict[str, Any]:
        return {}

    async def _move(self, chan: Channel, manifest: dict, tensors: list[torch.Tensor]) -> None:
        """Fill `tensors` (preallocated on `config.device`) with the sender's bytes.

        May send frames on `chan` (never read: the caller is reading it concurrently)."""
        raise NotImplementedError

    async def _fetch(self, target: Target) -> TransferPayload:
        chan = await self._connect(target)
        try:
            await chan.send({"t": "pull", "rid": target.request_id, **self._pull_fields()})
            manifest = await chan.recv()
            if manifest.get("t") == "error":
                raise error_from_code(manifest.get("code"), manifest.get("msg"))
            meta, specs = parse_manifest(manifest, target.request_id, self.config.max_state_bytes)
            digests = manifest.get("digests")
            if not isinstance(digests, list) or len(digests) != len(specs):
                raise CorruptFrame("manifest digests do not match its tensors")
            tensors = [spec.empty(self.config.device) for spec in specs]
            watch = await self._guarded(chan, self._move(chan, manifest, tensors))
            try:
                got = await tensor_digests(tensors)
                if not all(isinstance(d, bytes) and hmac.compare_digest(d, g)
                           for d, g in zip(digests, got, strict=True)):
                    raise CorruptFrame("tensor bytes do not match the manifest digests")
                await chan.send({"t": "done"})
                _expect_end(await watch)
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
            job.result()
            return watch
        except BaseException:
            watch.cancel()
            job.cancel()
            await asyncio.gather(watch, job, return_exceptions=True)
            raise


def _expect_end(header: dict) -> None:
    if header.get("t") == "error":
        raise error_from_code(header.get("code"), header.get("msg"))
    if header.get("t") != "end" or header["n"]:
        raise CorruptFrame(f"expected 'end', got {header.get('t')!r}")
