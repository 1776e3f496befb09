"""Decode leg: pull a prefill worker's state, always release its lease, apply the failure policy."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.core.state_export import ExportedState, StateMismatch
from kv_transfer.errors import TransferError
from kv_transfer.interface import KVReceiver
from shared.kv_transfer_params import KVTransferParams

log = logging.getLogger(__name__)


class KVLoadFailed(Exception):
    """The prefill state could not be loaded and the policy is `fail`."""


@dataclass
class PullResult:
    state: ExportedState | None          # None: recompute locally (policy `recompute`)
    seconds: float
    nbytes: int
    error: str | None = None


class StatePuller:
    def __init__(self, receiver: KVReceiver, policy: str) -> None:
        self.receiver, self.policy = receiver, policy

    async def pull(self, params: KVTransferParams, prompt_token_ids: list[int]) -> PullResult:
        start = time.perf_counter()
        try:
            payload = await self.receiver.pull(params)
            state = ExportedState.from_parts(payload.meta, payload.tensors)
            if list(state.prompt_token_ids) != list(prompt_token_ids):
                raise StateMismatch("the pulled state was computed for a different prompt")
            return PullResult(state, time.perf_counter() - start, payload.nbytes())
        except (TransferError, StateMismatch, KeyError, TypeError, ValueError) as exc:
            return self._failed(exc, start)
        finally:
            await self._release(params)

    def _failed(self, exc: Exception, start: float) -> PullResult:
        message = f"{type(exc).__name__}: {exc}"
        if self.policy == "fail":
            raise KVLoadFailed(f"could not load the prefill state: {message}") from exc
        log.warning("KV load failed, recomputing the prompt locally: %s", message)
        return PullResult(None, time.perf_counter() - start, 0, message)

    async def _release(self, params: KVTransferParams) -> None:
        try:
            await self.receiver.release(params)
        except TransferError as exc:                # the sender is gone: its lease will expire anyway
            log.warning("could not release prefill lease %s: %s", params.remote_request_id, exc)
