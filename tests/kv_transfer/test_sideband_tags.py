"""Publish-time tags of the sideband transports (`kv_transfer.sideband`): one key per state,
sealed to each session, and a tagger that stops reading a freed state's tensors."""

from __future__ import annotations

import os
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest
import torch

from kv_transfer.errors import CorruptFrame
from kv_transfer.payload import flat_bytes
from kv_transfer.sideband import DataTagger, StateTags, TaggingCancelled, seal_key, unseal_key
from kv_transfer.wire import derive_key


class _Session:
    """Stands in for an authenticated `Channel`: only its derived keys matter here."""

    def __init__(self, session_key: bytes) -> None:
        self.session_key = session_key

    def derived_key(self, context: bytes) -> bytes:
        return derive_key(context, self.session_key)


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1 << 20, 37, 0)]


def test_publish_tags_are_what_a_receiver_computes_over_the_same_bytes_only() -> None:
    sent = _tensors()
    state = StateTags(sent)
    with ThreadPoolExecutor(1) as pool:
        tags = state.start(pool).result()
    assert state.start(pool).result() is tags                   # computed once per state
    received = [t.clone() for t in sent]
    assert DataTagger(state.key, state.nonce, received).all_tags() == tags
    flat_bytes(received[0])[12345] ^= 1
    assert DataTagger(state.key, state.nonce, received).all_tags()[0] != tags[0]
    assert DataTagger(os.urandom(32), state.nonce, sent).all_tags() != tags   # another key


def test_a_sealed_key_opens_only_in_its_session_and_for_its_request() -> None:
    key, session = os.urandom(32), _Session(os.urandom(32))
    sealed = seal_key(session, key, "req-1")
    assert key not in sealed and unseal_key(session, sealed, "req-1") == key
    with pytest.raises(CorruptFrame, match="session"):
        unseal_key(_Session(os.urandom(32)), sealed, "req-1")    # another connection
    with pytest.raises(CorruptFrame, match="session"):
        unseal_key(session, sealed, "req-2")                     # another request's manifest
    with pytest.raises(CorruptFrame, match="sealed"):
        unseal_key(session, None, "req-1")
    assert seal_key(session, key, "req-1") != sealed              # fresh nonce per pull


def test_cancel_stops_tagging_a_freed_state() -> None:
    big = [torch.zeros(64 << 20, dtype=torch.uint8) for _ in range(4)]
    state = StateTags(big)
    with ThreadPoolExecutor(1) as pool:
        future = state.start(pool)
        state.cancel()              # returns only once no piece of `big` is being read
        with pytest.raises((TaggingCancelled, CancelledError)):
            future.result(timeout=30)
    assert state._tagger.tags[-1] is None
