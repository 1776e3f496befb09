"""The decode role's pull: the prefill lease is released on every path, and the failure policy decides
between recomputing locally and failing (no model needed: a scripted receiver)."""
from __future__ import annotations

import asyncio

import pytest

from decode_worker.pull import KVLoadFailed, StatePuller
from kv_transfer.errors import LeaseExpired, TransferError
from kv_transfer.payload import TransferPayload
from shared.kv_transfer_params import KVTransferParams

PARAMS = KVTransferParams(do_remote_prefill=True, remote_request_id="r1", remote_host="127.0.0.1", remote_port=9)


class ScriptedReceiver:
    """Answers pulls with `payload` or raises `error`; records every release."""

    def __init__(self, payload=None, error: Exception | None = None, release_error: Exception | None = None) -> None:
        self.payload, self.error, self.release_error = payload, error, release_error
        self.pulled: list[KVTransferParams] = []
        self.released: list[str] = []

    async def pull(self, params: KVTransferParams):
        self.pulled.append(params)
        if self.error is not None:
            raise self.error
        return self.payload

    async def release(self, params: KVTransferParams) -> bool:
        self.released.append(params.remote_request_id)
        if self.release_error is not None:
            raise self.release_error
        return True


def pull(receiver: ScriptedReceiver, policy: str, prompt: list[int] | None = None):
    return asyncio.run(StatePuller(receiver, policy).pull(PARAMS, prompt or [1, 2, 3]))


@pytest.mark.parametrize("error", [LeaseExpired("lease ended"), TransferError("connection reset")])
def test_recompute_policy_returns_no_state_and_releases(error) -> None:
    receiver = ScriptedReceiver(error=error)
    result = pull(receiver, "recompute")
    assert result.state is None and result.nbytes == 0 and type(error).__name__ in result.error
    assert receiver.pulled == [PARAMS] and receiver.released == ["r1"]


def test_fail_policy_raises_and_still_releases() -> None:
    receiver = ScriptedReceiver(error=LeaseExpired("lease ended"))
    with pytest.raises(KVLoadFailed, match="could not load the prefill state"):
        pull(receiver, "fail")
    assert receiver.released == ["r1"]


def test_a_state_that_cannot_be_read_is_a_load_failure() -> None:
    receiver = ScriptedReceiver(payload=TransferPayload("r1", {"prompt_token_ids": [1, 2, 3]}, {"bogus.0": None}))
    result = pull(receiver, "recompute")
    assert result.state is None and "StateMismatch" in result.error and receiver.released == ["r1"]


def test_a_release_that_fails_does_not_fail_the_request() -> None:
    receiver = ScriptedReceiver(error=TransferError("gone"), release_error=TransferError("sender gone"))
    assert pull(receiver, "recompute").state is None
    assert receiver.released == ["r1"]
