"""The mooncake receiver's read loop against a scripted engine (no Mooncake needed): it keeps
about `WINDOW_BYTES` in flight, tags each tensor once its read landed, and never returns while a
read may still write into the destination, whatever failed."""

from __future__ import annotations

import threading
import time

import pytest

from kv_transfer import mooncake
from kv_transfer.errors import PeerTimeout, TransferError
from kv_transfer.mooncake import _read_windows, _registration

pytestmark = pytest.mark.timeout(30)
MIB = 1 << 20


class ScriptedEngine:
    """Each read settles after `polls` status checks with `outcome` (1 ok, -1 failed)."""

    def __init__(self, polls: int = 2, outcome: dict[int, int] | None = None,
                 refuse_submit_at: int | None = None) -> None:
        self.polls, self.outcome, self.refuse_submit_at = polls, outcome or {}, refuse_submit_at
        self.batches: dict[int, list] = {}          # batch id -> [region local addr, checks left]
        self.settled: list[int] = []
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def batch_transfer_async_read(self, session, local, remote, sizes):
        assert len(local) == len(remote) == len(sizes) == 1
        if self.refuse_submit_at is not None and len(self.batches) == self.refuse_submit_at:
            return 0
        batch = len(self.batches) + 1
        self.batches[batch] = [local[0], self.polls, sizes[0]]
        in_flight = sum(b[2] for k, b in self.batches.items() if k not in self.settled)
        self.max_in_flight = max(self.max_in_flight, in_flight)
        return batch

    def transfer_check_status(self, batch):
        entry = self.batches[batch]
        assert batch not in self.settled, "status of a freed batch"
        entry[1] -= 1
        if entry[1] > 0:
            return 0
        self.settled.append(batch)
        return self.outcome.get(entry[0], 1)

    def in_flight(self) -> int:
        return len(self.batches) - len(self.settled)


class Tagger:
    def __init__(self) -> None:
        self.tagged: list[int] = []

    def tag(self, index: int) -> bytes:
        self.tagged.append(index)
        return bytes(16)


def _regions(count: int, size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    local = [1000 + i for i in range(count)]
    return local, [5000 + i for i in range(count)], [size] * count, list(range(count))


def test_every_region_is_read_once_and_tagged_within_the_window() -> None:
    engine, tagger = ScriptedEngine(), Tagger()
    local, remote, sizes, owners = _regions(20, 8 * MIB)
    _read_windows(engine, "s", local, remote, sizes, [10 + o for o in owners], tagger, 10)
    assert sorted(b[0] for b in engine.batches.values()) == local
    assert sorted(tagger.tagged) == [10 + o for o in owners]
    assert engine.in_flight() == 0
    assert engine.max_in_flight <= mooncake.WINDOW_BYTES + 8 * MIB


def test_a_failed_read_fails_the_pull_only_after_every_read_settled() -> None:
    local, remote, sizes, owners = _regions(12, 8 * MIB)
    engine, tagger = ScriptedEngine(polls=3, outcome={local[2]: -1}), Tagger()
    with pytest.raises(TransferError, match="failed"):
        _read_windows(engine, "s", local, remote, sizes, owners, tagger, 10)
    assert engine.in_flight() == 0          # nothing may still write into the receive buffers


def test_a_refused_submit_waits_for_the_reads_already_in_flight() -> None:
    local, remote, sizes, owners = _regions(12, 1 * MIB)
    engine = ScriptedEngine(polls=5, refuse_submit_at=4)
    with pytest.raises(TransferError, match="submit"):
        _read_windows(engine, "s", local, remote, sizes, owners, None, 10)
    assert len(engine.batches) == 4 and engine.in_flight() == 0


def test_reads_that_never_settle_are_abandoned_at_the_deadline() -> None:
    local, remote, sizes, owners = _regions(3, 1 * MIB)
    engine = ScriptedEngine(polls=10**9)
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as caught:
        _read_windows(engine, "s", local, remote, sizes, owners, None, 0.2)
    assert isinstance(caught.value, mooncake._Abandoned)       # memory must then be kept forever
    assert time.monotonic() - start < 2


def test_a_receive_arena_is_registered_as_one_span() -> None:
    assert _registration([0, 128, 256], [100, 100, 64]) == ([0], [320])
    assert _registration([0, 4096], [100, 100]) == ([0, 4096], [100, 100])      # far apart
    assert _registration([256, 0], [100, 100]) == ([256, 0], [100, 100])        # out of order
