"""A KV pool shared by the prefill workers (router/placement/kv_pool.py): what placement counts as cached
on each worker, what it charges for loading it, and that a request stops waiting for its prefix holder
once every worker can load that prefix from the pool."""
from __future__ import annotations

import argparse
import math
import threading
from pathlib import Path

import pytest

from router.cli import add_router_args, settings_from_args
from router.placement import HashKey, RoutingContext, WorkerState, build_pipeline
from router.placement.context import context_from_hashes
from router.placement.kv_pool import KVPool, KVPoolConfig
from router.placement.prefix_index import ApproximatePrefixIndex
from router.placement.scorers import expected_completion_s
from router.procs.share import ProcessShare
from router.procs.table import SharedTable
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.workers import WorkerInfo

BS = 16
P1, P2, DEC = "http://p1", "http://p2", "http://d1"


def info(wid: str, role: str) -> WorkerInfo:
    return WorkerInfo(wid, role, wid, "m", block_size=BS, hash_root=7)  # type: ignore[arg-type]


def context(tokens: int, hashes: tuple[int, ...], cached: dict[str, int], pooled: dict[str, int],
            load_cost: float = 0.1) -> RoutingContext:
    return RoutingContext("r", "m", "prefill", tokens, {HashKey(7, BS): hashes}, cached, pooled_blocks=pooled,
                          pool_load_cost=load_cost)


def test_config_checks_its_bounds():
    assert not KVPoolConfig().enabled and KVPoolConfig(blocks=8).enabled
    for bad in ({"blocks": -1}, {"load_cost": 0.0}, {"load_cost": 1.5}):
        with pytest.raises(ValueError):
            KVPoolConfig(**bad)
    with pytest.raises(ValueError):
        KVPool(KVPoolConfig())


def test_pool_is_a_bounded_chain_of_what_was_recorded():
    pool = KVPool(KVPoolConfig(blocks=4))
    pool.record([1, 2, 3])
    assert pool.matched_blocks([1, 2, 3, 9]) == 3
    assert pool.matched_blocks([9, 2, 3]) == 0                   # a miss ends the chain
    pool.record([5, 6])                                          # 5 blocks recorded, 4 kept: the oldest tail goes
    assert pool.num_blocks() == 4 and pool.matched_blocks([1, 2, 3]) == 2
    assert KVPool.member("prefill") and KVPool.member("both") and not KVPool.member("decode")


def test_pool_hits_are_not_computed_but_cost_their_load():
    hashes = tuple(range(10))                                    # 10 full blocks of a 170-token prompt
    ctx = context(170, hashes, cached={P1: 6, P2: 0}, pooled={P1: 8, P2: 8}, load_cost=0.25)
    p1, p2 = info(P1, "prefill"), info(P2, "prefill")
    assert ctx.uncached_tokens(p1) == ctx.uncached_tokens(p2) == 170 - 8 * BS
    assert ctx.pool_loaded_tokens(p1) == 2 * BS and ctx.pool_loaded_tokens(p2) == 8 * BS
    assert ctx.work_tokens(p1) == 42 + math.ceil(0.25 * 32) and ctx.work_tokens(p2) == 42 + 32
    # a worker whose own cache goes further than the pool loads nothing
    ahead = context(170, hashes, cached={P1: 10}, pooled={P1: 8})
    assert ahead.uncached_tokens(p1) == 10 and ahead.pool_loaded_tokens(p1) == 0 and ahead.work_tokens(p1) == 10
    # without a pool, the work is the uncached tokens
    plain = context(170, hashes, cached={P1: 6}, pooled={})
    assert plain.work_tokens(p1) == plain.uncached_tokens(p1) == 170 - 6 * BS


def test_loads_are_not_charged_the_recompute_weight():
    ctx = context(170, tuple(range(10)), cached={P2: 0}, pooled={P2: 8}, load_cost=0.5)
    state = WorkerState(info(P2, "prefill"), tokens_per_s=1000.0, backlog_s=1.0)
    # 1 s queued + 32 x 42 computed tokens + 0.5 x 128 loaded tokens, at 1000 tokens/s
    assert expected_completion_s(ctx, state, own_weight=32.0) == pytest.approx(1.0 + (32 * 42 + 64) / 1000)


def test_context_gives_the_pool_to_its_members_only():
    pool = KVPool(KVPoolConfig(blocks=64, load_cost=0.2))
    hashes = (11, 12, 13, 14)
    pool.record(hashes[:3])
    workers = [WorkerState(info(P1, "prefill")), WorkerState(info("http://b", "both")),
               WorkerState(info(DEC, "decode"))]
    index = ApproximatePrefixIndex(64)                           # no worker holds anything
    ctx = context_from_hashes("r", 80, {HashKey(7, BS): hashes}, workers, index, model="m", role="prefill",
                              now=0.0, pool=pool)
    assert dict(ctx.pooled_blocks) == {P1: 3, "http://b": 3} and ctx.pool_load_cost == 0.2
    assert ctx.uncached_tokens(workers[2].info) == 80            # a decode worker cannot load from the pool


def registry(pool_blocks: int) -> WorkerRegistry:
    settings = RouterSettings(model=None, static_prefill=(P1, P2), static_decode=(DEC,), block_size=BS,
                              prefill_tokens_per_s=1000.0, static_cache_tokens=1 << 20, kv_pool_blocks=pool_blocks)
    return WorkerRegistry(settings, None, clock=lambda: 50.0)


def computed(reg: WorkerRegistry, worker: str, hashes, calibrate: bool = True) -> None:
    """A leg that computes the prompt on `worker`, answered (or given up on: calibrate=False)."""
    reg.settle_leg(reg.open_leg(reg.all_infos()[worker], 10, hashes), calibrate=calibrate)


def test_answered_prefills_of_members_fill_the_pool():
    reg = registry(1024)
    assert reg.pool is not None and registry(0).pool is None
    computed(reg, DEC, [1, 2, 3])                                # a decode worker does not fill the pool
    assert reg.pool.matched_blocks([1, 2, 3]) == 0
    computed(reg, P1, [1, 2, 3], calibrate=False)                # a leg that failed saved nothing
    assert reg.pool.matched_blocks([1, 2, 3]) == 0
    leg = reg.open_leg(reg.all_infos()[P1], 10, [1, 2, 3])
    assert reg.pool.matched_blocks([1, 2, 3]) == 0, "not in the pool while its prefill runs"
    reg.settle_leg(leg)
    assert reg.pool.matched_blocks([1, 2, 3]) == 3
    reg.settle_leg(leg, calibrate=False)                         # a second settle changes nothing
    assert reg.pool.num_blocks() == 3 and reg.ledger.open_legs(P1) == 0
    reg.settle_leg(reg.open_leg(reg.all_infos()[P2], 0, [4, 5]))  # a leg with no prefill work (a transfer)
    assert reg.pool.matched_blocks([4, 5]) == 0


def place(reg: WorkerRegistry, hashes: tuple[int, ...], tokens: int) -> str:
    states = reg.states()
    ctx = context_from_hashes("r", tokens, {HashKey.of(reg.all_infos()[P1]): hashes}, states, reg.index,
                              model=reg.settings.served_model_name, role="prefill", now=50.0,
                              tail_prefill_s=reg.ledger.tail_prefill_s(), pool=reg.pool)
    pipeline = build_pipeline(**reg.settings.pipeline_spec())
    return pipeline.pick(ctx, [s for s in states if s.info.role == "prefill"]).worker.worker_id


@pytest.mark.parametrize("pool_blocks, expected", [(0, P1), (4096, P2)])
def test_a_request_stops_waiting_for_its_prefix_holder_when_the_pool_has_the_prefix(pool_blocks, expected):
    """p1 computed a 60-block prefix and has 2 s of work queued. Without a pool, p2 would recompute the
    whole prefix (charged 32x: it costs later requests their cache), so the request waits on p1; with the
    pool, p2 loads the prefix and starts now."""
    reg = registry(pool_blocks)
    prefix = tuple(range(1000, 1060))
    reg.index.record_sent(P1, prefix)
    computed(reg, P1, prefix)
    reg.ledger.open(P1, 2000)                                    # 2 s at 1000 tokens/s
    assert place(reg, (*prefix, 5000, 5001), 62 * BS + 3) == expected


def test_sibling_processes_fill_each_others_pool(tmp_path: Path):
    table = SharedTable.create(str(tmp_path / "table"), 2, threading.Lock())
    try:
        regs = [registry(1024), registry(1024)]
        for i, reg in enumerate(regs):
            ProcessShare(table, i, group="g").attach(reg)
        for reg in regs:
            assert reg.share is not None
            reg.share.know(reg.all_infos())
        a, b = regs
        computed(a, P1, [7, 8, 9])
        computed(a, DEC, [20, 21])
        b.states()                                               # a placement read applies the siblings' records
        assert b.pool is not None and b.pool.matched_blocks([7, 8, 9]) == 3 and b.pool.matched_blocks([20, 21]) == 0
        assert a.pool is not None and a.pool.num_blocks() == b.pool.num_blocks() == 3
    finally:
        table.close()


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


def test_flags_reach_the_settings_and_bad_values_are_refused():
    args = parse("--prefill", P1, "--decode", DEC, "--kv-pool-blocks", "4096", "--kv-pool-load-cost", "0.05")
    settings = settings_from_args(args, None)
    assert (settings.kv_pool_blocks, settings.kv_pool_load_cost) == (4096, 0.05)
    settings.validate()
    bad = settings_from_args(parse("--prefill", P1, "--decode", DEC, "--kv-pool-load-cost", "0"), None)
    with pytest.raises(ValueError, match="kv-pool"):
        bad.validate()
