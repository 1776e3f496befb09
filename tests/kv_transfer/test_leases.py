"""LeaseTable: expiry, exactly-once free, readers deferring the free; a fake clock, no I/O."""

from __future__ import annotations

import threading

import pytest

from kv_transfer.errors import DuplicateRequest, LeaseExpired, RequestAborted, SenderShutdown, UnknownRequest
from kv_transfer.leases import LeaseTable
from tests.kv_transfer.helpers import Clock, FreeLog

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    return LeaseTable(clock, remembered=8)


def test_release_frees_once_and_later_reads_are_unknown(table: LeaseTable) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    assert table.held_count() == 1
    assert table.end("a", "released") is True
    assert table.end("a", "released") is False
    assert table.end("a", "aborted") is False
    assert log.calls == [("a", "released")]
    assert table.held_count() == 0
    with pytest.raises(UnknownRequest, match="already released"):
        table.acquire("a")
    with pytest.raises(UnknownRequest, match="no lease"):
        table.acquire("never-published")


def test_expiry_needs_no_sweep_to_refuse_reads(table: LeaseTable, clock: Clock) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    clock.now += 9.999
    table.unacquire(table.acquire("a"))
    clock.now += 0.001
    with pytest.raises(LeaseExpired):
        table.acquire("a")
    with pytest.raises(LeaseExpired):
        table.acquire("a")
    assert log.calls == [("a", "expired")]
    assert table.sweep() == 0 and table.held_count() == 0


def test_sweep_ends_only_due_leases(table: LeaseTable, clock: Clock) -> None:
    log = FreeLog()
    table.add("short", 1, 1, log)
    table.add("long", 2, 5, log)
    clock.now += 2
    assert table.sweep() == 1
    assert log.calls == [("short", "expired")]
    assert table.held_count() == 1
    clock.now += 10
    assert table.sweep() == 1 and table.sweep() == 0
    assert log.calls == [("short", "expired"), ("long", "expired")]


def test_end_during_read_defers_free_until_last_reader(table: LeaseTable, clock: Clock) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    first, second = table.acquire("a"), table.acquire("a")
    clock.now += 11
    assert table.sweep() == 1
    assert log.calls == [] and table.held_count() == 1      # still being read: not freed yet
    with pytest.raises(LeaseExpired):
        table.check(first)                                   # but no reader may report success
    table.unacquire(first)
    assert log.calls == []
    table.unacquire(second)
    assert log.calls == [("a", "expired")] and table.held_count() == 0


def test_check_detects_expiry_between_sweeps(table: LeaseTable, clock: Clock) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    lease = table.acquire("a")
    table.check(lease)
    clock.now += 10
    with pytest.raises(LeaseExpired):
        table.check(lease)
    table.unacquire(lease)
    assert log.calls == [("a", "expired")]


@pytest.mark.parametrize(("reason", "error"), [("aborted", RequestAborted), ("shutdown", SenderShutdown)])
def test_abort_and_shutdown_are_typed_for_readers(table: LeaseTable, reason: str, error: type) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    lease = table.acquire("a")
    if reason == "shutdown":
        table.close()
    else:
        table.end("a", reason)
    with pytest.raises(error):
        table.check(lease)
    with pytest.raises(error):
        table.acquire("a")
    table.unacquire(lease)
    assert log.calls == [("a", reason)]


def test_first_end_wins(table: LeaseTable, clock: Clock) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    lease = table.acquire("a")
    table.end("a", "aborted")
    clock.now += 100
    table.sweep()
    table.end("a", "released")
    table.close()
    table.unacquire(lease)
    assert log.calls == [("a", "aborted")]


def test_duplicate_add_refused_until_freed(table: LeaseTable) -> None:
    log = FreeLog()
    table.add("a", "state", 10, log)
    with pytest.raises(DuplicateRequest):
        table.add("a", "other", 10, log)
    lease = table.acquire("a")
    table.end("a", "released")
    with pytest.raises(DuplicateRequest):       # ended but still read: memory not yet freed
        table.add("a", "other", 10, log)
    table.unacquire(lease)
    table.add("a", "again", 10, log)
    table.unacquire(table.acquire("a"))
    assert table.held_count() == 1
    with pytest.raises(ValueError):
        table.add("b", "state", 0, log)


def test_close_frees_everything_once(table: LeaseTable) -> None:
    log = FreeLog()
    for rid in "abc":
        table.add(rid, rid, 10, log)
    table.close()
    table.close()
    assert sorted(log.calls) == [("a", "shutdown"), ("b", "shutdown"), ("c", "shutdown")]
    assert table.held_count() == 0


def test_failing_callback_does_not_break_the_table(table: LeaseTable) -> None:
    def boom(request_id: str, reason: str) -> None:
        raise RuntimeError("caller bug")

    table.add("a", "state", 10, boom)
    assert table.end("a", "released") is True
    assert table.held_count() == 0


def test_memory_of_ended_leases_is_bounded(table: LeaseTable) -> None:
    log = FreeLog()
    for i in range(20):
        table.add(f"r{i}", i, 10, log)
        table.end(f"r{i}", "aborted")
    with pytest.raises(RequestAborted):
        table.acquire("r19")
    with pytest.raises(UnknownRequest):
        table.acquire("r0")                      # forgotten: only the last 8 are remembered
    assert len(log.calls) == 20


def test_concurrent_ends_free_exactly_once(clock: Clock) -> None:
    table = LeaseTable(clock)
    log = FreeLog()
    for i in range(200):
        table.add(str(i), i, 10, log)
    clock.now += 5
    barrier = threading.Barrier(4)

    def worker(kind: int) -> None:
        barrier.wait()
        for i in range(200):
            if kind == 0:
                table.end(str(i), "released")
            elif kind == 1:
                table.end(str(i), "aborted")
            elif kind == 2:
                clock.now += 0.05
                table.sweep()
            else:
                table.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(rid) for rid, _ in log.calls) == list(range(200))
    assert table.held_count() == 0


def test_renewal_extends_a_short_lease_up_to_the_full_one(table: LeaseTable, clock: Clock) -> None:
    """A router renews a 5 s lease every second: it lives on, but never past the full lease (30 s from
    its publication); once renewals stop it ends 5 s after the last one. Ended leases are not renewed."""
    log = FreeLog()
    table.add("a", "state", 5, log)
    for _ in range(20):
        clock.now += 1
        assert table.renew("a", 5, max_total_s=30)
    assert table.sweep() == 0                      # 20 s: renewed past its first 5 s
    clock.now += 4.9
    assert table.sweep() == 0
    clock.now += 0.1
    assert table.sweep() == 1 and log.calls == [("a", "expired")]
    assert not table.renew("a", 5, max_total_s=30) and not table.renew("unknown", 5, max_total_s=30)
    table.add("b", "state", 5, log)
    added = clock.now
    for _ in range(40):                            # renewed for 40 s: still freed at 30 s
        clock.now += 1
        table.renew("b", 5, max_total_s=30)
        if table.sweep():
            break
    assert log.calls[-1] == ("b", "expired") and clock.now - added == 30
