"""`--workers N` state sharing, in one process: two registries, each hooked to its own `ProcessShare` on one
table, must see what the other did as one registry would have (router/procs/share.py). The real processes
on one port are tested in test_router_processes.py."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

from router.admission.accounting import Accounting
from router.admission.limits import Throttled
from router.admission.queue import AdmissionQueue
from router.health_checker import round_record
from router.procs.share import ProcessShare, apply_round
from router.procs.table import SharedTable
from router.registry import WorkerRegistry
from router.settings import RouterSettings

W1, W2 = "http://w1", "http://w2"
SETTINGS = RouterSettings(model=None, static_decode=(W1, W2), prefill_tokens_per_s=1000.0, static_cache_tokens=1 << 20)


@pytest.fixture
def table(tmp_path: Path):
    t = SharedTable.create(str(tmp_path / "table"), 2, threading.Lock())
    yield t
    t.close()


def pair(table: SharedTable, clock=None, settings: RouterSettings = SETTINGS) -> tuple[WorkerRegistry, WorkerRegistry]:
    regs = []
    for i in range(2):
        reg = WorkerRegistry(settings, None) if clock is None else WorkerRegistry(settings, None, clock=clock)
        ProcessShare(table, i, group="g", **({} if clock is None else {"clock": clock})).attach(reg)
        regs.append(reg)
    for reg in regs:
        assert reg.share is not None
        reg.share.know(reg.all_infos())
    return regs[0], regs[1]


def view(reg: WorkerRegistry) -> dict[str, tuple[int, float]]:
    return {s.worker_id: (s.inflight, round(s.backlog_s, 3)) for s in reg.states()}


def test_load_one_process_opens_is_load_the_other_sees(table):
    now = [100.0]
    a, b = pair(table, clock=lambda: now[0])
    a.begin(W1)
    leg = a.ledger.open(W1, 3000)                 # 3 s of work at 1000 tokens/s
    assert view(b) == {W1: (1, 3.0), W2: (0, 0.0)} == view(a)
    now[0] += 1.0                                 # the open leg progresses the same in both views
    assert view(b)[W1] == view(a)[W1] == (1, 2.0)
    b.begin(W2)
    assert view(a)[W2] == (1, 0.0)
    a.end(W1, ok=True)
    assert view(b)[W1] == (0, 2.0)                # the leg's work stays until its ledger entry settles
    a.ledger.settle(leg)
    assert view(b)[W1] == (0, 0.0)
    assert a.router_id == "g-0" and b.sibling_prefix == "g-"


def test_a_prefix_sent_by_one_process_is_held_by_the_other(table):
    a, b = pair(table)
    a.index.record_sent(W2, [11, 12, 13])
    b.states()                                    # placement reads the log first
    assert b.index.matched_blocks(W2, [11, 12, 13, 14]) == 3
    assert b.index.matched_blocks(W1, [11]) == 0
    assert a.index.matched_blocks(W2, [11, 12, 13]) == 3   # its own send, once (not replayed to itself)


def test_many_sibling_sends_replayed_at_once_leave_the_senders_own_view(table):
    """The log since a process's last placement is replayed per worker in one pass; sends to a worker
    added in the same stretch of log are kept, sends to one never added are not."""
    a, b = pair(table)
    for reg in (a, b):
        reg.index.approximate.set_capacity(W1, 7)             # small: the replay must evict as the sender did
    head = [1, 2, 3]
    a.index.record_sent(W1, head + [10, 11])
    a.index.record_sent(W2, [50, 51])
    a.index.record_sent(W1, head + [12])
    a.add_static("http://w3", "decode")
    a.index.record_sent("http://w3", head + [13])
    a.index.record_sent(W1, [20, 21, 22, 23])
    a.index.record_sent(W1, head + [10])
    a.index.record_sent("http://nowhere", [1])               # a worker this process never had
    b.states()
    for wid in (W1, W2, "http://w3"):
        assert list(b.index.approximate._lru[wid]) == list(a.index.approximate._lru[wid])
    assert "http://nowhere" not in b.index.approximate._lru
    assert b.index.matched_blocks(W1, head + [10, 11]) == 4                 # 11 was evicted, in both
    assert a.index.matched_blocks(W1, head + [10, 11]) == 4


def test_a_pull_reported_to_one_process_prices_moves_in_the_other(table):
    a, b = pair(table, settings=dataclasses.replace(SETTINGS, transfer_aware=True))
    assert b.transfer.expected_s(W1, 100) is None             # nothing measured anywhere yet
    a.transfer.observe(W1, 1000, 2.0)                         # a slow link, reported to process a
    b.states()                                                # placement reads the log first
    assert b.transfer.expected_s(W1, 100) == pytest.approx(a.transfer.expected_s(W1, 100)) == pytest.approx(0.2)
    assert b.transfer.expected_s(W2, 100) == pytest.approx(0.2)     # an unmeasured worker borrows the pool's
    a.states()
    assert a.transfer.expected_s(W1, 1000) == pytest.approx(2.0)    # its own pull, counted once


def test_admin_changes_reach_live_and_later_processes(table):
    a, b = pair(table)
    a.add_static("http://w3", "decode")
    assert a.drain(W1)
    b.states()
    assert "http://w3" in b.static and W1 in b.drained
    late = WorkerRegistry(SETTINGS, None)         # a restarted process, after the log moved on
    ProcessShare(table, 1).attach(late)
    assert "http://w3" in late.static and W1 in late.drained


def test_health_rounds_of_the_leader_are_applied_by_the_others(table):
    a, b = pair(table)
    for _ in range(2):                            # two misses in a row: unhealthy
        a.health.record_check(W1, False)
        assert a.share is not None
        a.share.health_round(round_record(a, {W1: False, W2: True}))
    b.states()
    assert not b.health.is_healthy(W1) and b.health.is_healthy(W2)
    apply_round(b, [["http://gone", True, None, None, None]])    # a worker this process does not know: ignored


def test_admission_slots_and_queue_bound_hold_for_the_router_as_a_whole(table):
    a, b = pair(table)
    queues = [AdmissionQueue(lambda: 2, 1, 0.2, siblings=reg.share) for reg in (a, b)]

    async def go():
        await queues[0].acquire((0, 0))
        await queues[1].acquire((0, 0))           # 2 slots in all: both taken, one per process
        waiter = asyncio.ensure_future(queues[0].acquire((0, 0)))
        await asyncio.sleep(0.01)
        with pytest.raises(Throttled) as full:    # the router's queue (bound 1) is full, whichever process
            await queues[1].acquire((0, 0))
        assert full.value.code == "queue_full"
        queues[1].release()                       # a slot frees in the other process ...
        queues[0].pump()                          # ... and goes to this one's waiter at its next pump
        await waiter
        assert queues[0].inflight == 2 and queues[1].inflight == 0
    asyncio.run(go())


def test_tenant_usage_adds_up_over_processes(table):
    a, b = pair(table)
    mine, theirs = Accounting(), Accounting()
    mine.finished("acme", 10, 5, "ok", 1.0)
    theirs.finished("acme", 20, 7, "ok", 3.0)
    theirs.rejected("acme", "rate_limited")
    assert b.share is not None and a.share is not None
    b.share.publish_usage(theirs.raw())
    mine.siblings = a.share.sibling_usage
    assert mine.snapshot()["acme"] == {"requests": 2, "prompt_tokens": 30, "completion_tokens": 12,
                                       "rejected": {"rate_limited": 1}, "outcomes": {"ok": 2}, "mean_seconds": 2.0}


def test_a_dead_process_load_is_cleared(table):
    a, b = pair(table)
    a.begin(W1)
    a.ledger.open(W1, 3000)
    table.clear_proc(0)                           # the parent, before restarting process 0
    assert view(b)[W1] == (0, 0.0)


def test_the_log_reads_back_every_record_across_the_rings_end_and_reports_a_reader_lapped(table):
    from router.procs.table import LOG_CAP
    size = 100_003                                            # not a divisor of the ring: records straddle its end
    reader, behind = table.log_tail, table.log_tail
    sent, got = [], []
    for i in range(3 * LOG_CAP // size):
        payload = bytes([i % 251]) * (size - i % 7)
        table.append(1 + i % 5, i % 2, payload)
        sent.append((1 + i % 5, i % 2, payload))
        if i % 3 == 2:                                        # a reader that keeps up, a few records at a time
            reader, records, lapped = table.read_since(reader)
            assert not lapped
            got += records
    reader, records, lapped = table.read_since(reader)
    got += records
    assert got == sent
    pos, records, lapped = table.read_since(behind)           # the oldest records were overwritten
    assert lapped and records == [] and pos == table.log_head
