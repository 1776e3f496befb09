"""Prefill leg: a finished, held prefill becomes a published transfer under a lease.

The engine keeps the request's pages and KDA slot until the transfer layer frees the lease
(released by the decode worker, expired, aborted or shut down); `on_free` then releases them in
the engine, so every path frees exactly once and nothing is stranded.
"""
from __future__ import annotations

import asyncio
import logging

from engine.async_engine import AsyncEngine
from engine.core.state_export import ExportedState
from kv_transfer.interface import KVSender
from kv_transfer.payload import TransferPayload
from shared.kv_transfer_params import KVTransferParams

log = logging.getLogger(__name__)


def to_payload(state: ExportedState) -> TransferPayload:
    meta, tensors = state.to_parts()
    return TransferPayload(state.request_id, meta, tensors)


class PrefillHandoff:
    def __init__(self, engine: AsyncEngine, sender: KVSender, lease_s: float) -> None:
        self.engine, self.sender, self.lease_s = engine, sender, lease_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def publish(self, request_id: str, lease_s: float | None = None) -> KVTransferParams:
        """Export the held state of `request_id` and publish it under `lease_s` (None: the full lease); the
        engine frees it when the lease ends."""
        self._loop = asyncio.get_running_loop()
        try:
            state = await self.engine.export_state(request_id)
            params = self.sender.publish(to_payload(state), lease_s or self.lease_s, self._on_free)
        except BaseException:
            await self.engine.release_export(request_id, "publish failed")
            raise
        params.remote_num_tokens = len(state.prompt_token_ids)
        return params

    def _on_free(self, request_id: str, reason: str) -> None:
        """Called by the transfer layer (any thread) exactly once per published request."""
        log.debug("prefill state %s freed (%s)", request_id, reason)
        self.engine.abort_nowait(request_id)      # abort of a HELD request releases its export
