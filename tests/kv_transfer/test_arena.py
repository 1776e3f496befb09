"""Receive arenas: pulls land in reused, already paged-in memory, but never in memory a caller
still holds (a tensor, or any view of one)."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.arena import ReceiveArenas
from kv_transfer.interface import make_receiver, make_sender
from kv_transfer.payload import TensorSpec
from tests.kv_transfer.helpers import FreeLog, assert_same, config, hybrid_payload, metrics, run, serving

pytestmark = pytest.mark.timeout(30)
SPECS = [TensorSpec("a", "bfloat16", (100, 3)), TensorSpec("b", "float32", (7,)),
         TensorSpec("c", "int64", ()), TensorSpec("e", "float32", (0, 4)), TensorSpec("d", "bool", (5,))]


def _base(tensors: list[torch.Tensor]) -> int:
    return tensors[0].data_ptr()


def test_tensors_have_the_specs_shapes_and_aligned_disjoint_memory() -> None:
    tensors = ReceiveArenas(1 << 20).tensors(SPECS)
    assert [(t.dtype, tuple(t.shape)) for t in tensors] == [
        (torch.bfloat16, (100, 3)), (torch.float32, (7,)), (torch.int64, ()), (torch.float32, (0, 4)),
        (torch.bool, (5,))]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_an_arena_is_reused_only_once_nothing_references_it() -> None:
    arenas = ReceiveArenas(1 << 20)
    first = arenas.tensors(SPECS)
    second = arenas.tensors(SPECS)
    assert _base(second) != _base(first)                       # first is still held
    kept = first[1][2:4]                                        # a view outlives its tensors
    old = _base(first)
    del first
    third = arenas.tensors(SPECS)
    assert _base(third) != old
    del kept
    assert _base(arenas.tensors(SPECS)) == old                  # now free: reused


def test_the_pool_keeps_at_most_max_bytes_and_zero_disables_it() -> None:
    arenas = ReceiveArenas(4096)
    held = [arenas.tensors([TensorSpec("x", "uint8", (3000,))]) for _ in range(3)]
    assert arenas.pooled_bytes() <= 4096
    del held
    assert ReceiveArenas(0).tensors(SPECS)[0].shape == (100, 3)
    off = ReceiveArenas(0)
    off.tensors(SPECS)
    assert off.pooled_bytes() == 0


def test_a_later_pull_never_overwrites_a_state_the_caller_still_holds() -> None:
    """Two pulls of different states through one receiver: the first payload, still held, is
    intact after the second lands; once dropped, its arena carries the third pull."""
    states = [hybrid_payload(f"r{i}", tokens=256, seed=i) for i in range(3)]

    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            params = [sender.publish(p, None, FreeLog()) for p in states]
            receiver = make_receiver(config(), metrics())
            first = await receiver.pull(params[0])
            second = await receiver.pull(params[1])
            assert_same(states[0], first)
            assert_same(states[1], second)
            address = first.tensors["mla.3"].data_ptr()
            assert second.tensors["mla.3"].data_ptr() != address
            del first
            third = await receiver.pull(params[2])
            assert_same(states[2], third)
            assert third.tensors["mla.3"].data_ptr() == address      # reused, already paged in
            assert_same(states[1], second)

    run(go())
