"""The placement replay's simulator and its honesty rules: one worker leaves every policy the same
choice (so all must give the same answers), and the load asked for is the load of the part reported."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.placement_replay import (
    DEFAULT_CANDIDATE,
    TUNE_GRID,
    interleaved_windows,
    part_bounds,
    router_settings,
    scaled,
    variant_args,
)
from benchmarks.placement_sim import (
    TRACE_BLOCK,
    Request,
    clairvoyant,
    earliest_free,
    nearest_rank,
    new_fleet,
    p99_ratio_interval,
    pooled_lru_hit,
    round_robin,
    router_fleet,
    run_router,
    run_simple,
    tail_breakdown,
)


def args(**kw) -> argparse.Namespace:
    base = dict(cache_blocks=1024, tokens_per_s=10000.0, heartbeat_s=1.0, report_delay_s=0.25, reply_delay_s=0.0,
                speed_spread=0.0, overhead_s=0.0, scorers=None, filters=None, split=0.5, warmup=0.2)
    return argparse.Namespace(**{**base, **kw})


def workload(n: int = 120) -> list[Request]:
    """Conversations of growing prompts over a few shared system prompts, arriving in bursts."""
    reqs = []
    for i in range(n):
        blocks = (i % 3, *(100 + 10 * (i % 7) + k for k in range(1 + i % 5)))
        reqs.append(Request(arrival=0.2 * (i // 4), tokens=len(blocks) * TRACE_BLOCK + 100, blocks=blocks))
    return reqs


def test_one_worker_every_policy_is_the_same_fifo():
    a, reqs = args(), workload()
    ours = run_router(reqs, 1, a, router_settings(1, a, legacy=False), scored=30)
    for other in (run_simple(reqs, 1, a, round_robin, scored=30), run_simple(reqs, 1, a, clairvoyant(32.0), scored=30),
                  run_simple(reqs, 1, a, earliest_free, shared_cache=True, scored=30)):
        for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s"):
            assert ours[key] == pytest.approx(other[key])


def test_scored_part_excludes_the_warm_up():
    fleet = new_fleet(1, args())
    for req in workload(8):
        fleet.serve(0, req)
    assert fleet.result(4)["ttft_mean_s"] == pytest.approx(sum(fleet.ttft[4:]) / 4)
    assert part_bounds(100, args(), tuning=False) == (100, 50)     # held out: 50.., after 0..50 as warm-up
    assert part_bounds(100, args(), tuning=True) == (50, 10)       # tuning: 10..50


def test_load_is_that_of_the_reported_part():
    rows = [{"timestamp": t, "input_length": n, "hash_ids": [0, 1]} for t, n in
            [(0, 1000), (1000, 1000), (2000, 4000), (3000, 4000), (4000, 4000)]]
    reqs = scaled(rows, 1.2, 1000.0, basis=(2, 5))                  # 12000 tokens over the last 2 (trace) s
    span = reqs[4].arrival - reqs[2].arrival
    assert sum(r.tokens for r in reqs[2:]) / span == pytest.approx(1.2 * 1000.0)


def test_interleaved_windows_alternate_after_the_warm_up():
    stamps = [float(t) for t in range(100)]                        # one request per second
    tuning, held_out = interleaved_windows(stamps, warmup=0.2, windows=4)
    assert tuning[0] == 20 and min(held_out) > 20                   # the first 20 are warm-up, scored by neither
    assert sorted(tuning + held_out) == list(range(20, 100))        # every later request in exactly one set
    # windows of ~19.75 s: tuning 20..39 and 60..79, held out 40..59 and 80..99
    assert tuning == [*range(20, 40), *range(60, 80)] and held_out == [*range(40, 60), *range(80, 100)]


def test_scored_indices_give_the_figures_of_those_requests_only():
    a, reqs = args(), workload()
    picked = list(range(10, 120, 3))
    fleet, _ = router_fleet(reqs, 2, a, router_settings(2, a, legacy=False))
    got = fleet.result(picked)
    ttfts = sorted(fleet.ttft[i] for i in picked)
    assert got["ttft_mean_s"] == pytest.approx(sum(ttfts) / len(ttfts))
    assert got["ttft_p99_s"] == ttfts[-1]                           # nearest rank of 37 values: the largest
    assert got["hit_ratio"] == pytest.approx(sum(fleet.hits[i] for i in picked) / sum(reqs[i].tokens for i in picked))
    # one scored index list and one start give the same figures where they name the same requests
    assert fleet.result(list(range(30, 120))) == fleet.result(30)
    assert pooled_lru_hit(reqs, 64, list(range(30, 120))) == pooled_lru_hit(reqs, 64, 30)


def test_p99_interval_is_paired_and_brackets_the_ratio():
    import random
    rng = random.Random(1)
    oracle = [rng.expovariate(1.0) for _ in range(3000)]
    assert p99_ratio_interval([1.5 * t for t in oracle], oracle, range(3000)) == pytest.approx((1.5, 1.5))
    ours = [t * rng.uniform(0.8, 1.6) for t in oracle]             # a noisy tail
    lo, hi = p99_ratio_interval(ours, oracle, range(3000), draws=300)
    point = nearest_rank(sorted(ours), 0.99) / nearest_rank(sorted(oracle), 0.99)
    assert lo < point < hi and hi - lo > 0.02                        # a p99 over 3,000 requests is not exact
    # only the scored requests count: a huge outlier outside them changes nothing
    assert p99_ratio_interval([*ours, 1e9], [*oracle, 1.0], range(3000), draws=300) == (lo, hi)


def test_the_default_candidate_is_the_routers_default_policy():
    """The interleaved table's "router default" column reads DEFAULT_CANDIDATE: it must be what the router
    runs when nobody configures it, or the column names the wrong policy."""
    a = args(scorers=None, filters=None)
    assert DEFAULT_CANDIDATE in TUNE_GRID
    chosen = router_settings(4, variant_args(a, *DEFAULT_CANDIDATE), legacy=False)
    assert chosen.pipeline_spec() == router_settings(4, a, legacy=False).pipeline_spec()


def test_a_pool_serves_what_any_worker_computed_at_its_load_cost():
    a = args(kv_pool=1.0, kv_pool_load_cost=0.25)
    fleet = new_fleet(2, a)
    req = Request(arrival=0.0, tokens=4 * TRACE_BLOCK + 100, blocks=(1, 2, 3, 4))
    fleet.serve(0, req)                                              # computes all, saves it to the pool
    later = Request(arrival=10.0, tokens=req.tokens, blocks=req.blocks)
    fleet.serve(1, later)                                            # loads the four blocks, computes the rest
    assert fleet.ttft[1] == pytest.approx((100 + 0.25 * 4 * TRACE_BLOCK) / a.tokens_per_s)
    fleet.serve(0, Request(arrival=20.0, tokens=req.tokens, blocks=req.blocks))   # its own cache: no load
    assert fleet.ttft[2] == pytest.approx(100 / a.tokens_per_s)
    assert fleet.hits == [0, 4 * TRACE_BLOCK, 4 * TRACE_BLOCK]
    assert new_fleet(2, args()).pool is None and new_fleet(2, a, shared_cache=True).pool is None


def test_the_clairvoyant_baseline_sees_the_pool():
    """Worker 0 computed a 10-block prompt and is now busy with another; the same prefix arrives again. With a
    pool, perfect knowledge loads it on idle worker 1; without, recomputing it there (charged 32x) loses."""
    first = Request(arrival=0.0, tokens=10 * TRACE_BLOCK, blocks=tuple(range(10)))
    other = Request(arrival=0.6, tokens=40 * TRACE_BLOCK, blocks=tuple(range(100, 140)))
    again = Request(arrival=0.7, tokens=10 * TRACE_BLOCK + 50, blocks=tuple(range(10)))
    for pool, expected in ((1.0, 1), (0.0, 0)):
        fleet = new_fleet(2, args(kv_pool=pool))
        fleet.serve(0, first)
        fleet.serve(0, other)
        assert clairvoyant(32.0)(fleet, again, 1) == expected


def test_the_pool_holds_a_prompt_once_its_prefill_has_finished():
    fleet = new_fleet(2, args(kv_pool=1.0))
    first = Request(arrival=0.0, tokens=4 * TRACE_BLOCK, blocks=(1, 2, 3, 4))     # done at 0.2048 s
    fleet.serve(0, first)
    assert fleet.pooled(Request(arrival=0.1, tokens=first.tokens, blocks=first.blocks)) == 0
    assert fleet.pooled(Request(arrival=0.3, tokens=first.tokens, blocks=first.blocks)) == 4


def test_the_router_can_be_told_another_pool_size_than_the_fleet_has():
    a = args(kv_pool=1.0, kv_pool_told=0.5)
    assert new_fleet(2, a).pool.capacity == 2 * a.cache_blocks            # the truth
    assert router_settings(2, a, legacy=False).kv_pool_blocks == a.cache_blocks   # what the router believes
    assert router_settings(2, args(kv_pool=1.0, kv_pool_told=0.0), legacy=False).kv_pool_blocks == 0


def test_the_tail_breakdown_tells_a_queued_cached_request_from_a_long_one():
    """C's prefix is cached on worker 0, where it waits behind two long prompts; the oracle (one shared cache)
    serves it at once on the worker A left. C is ours' slowest request; the oracle's slowest is a long prompt."""
    a = args()
    prefix = tuple(range(10))
    reqs = [Request(0.0, 10 * TRACE_BLOCK, prefix),                                   # A
            Request(0.6, 50 * TRACE_BLOCK, tuple(range(100, 150))),                   # B1
            Request(0.6, 50 * TRACE_BLOCK, tuple(range(200, 250))),                   # B2
            Request(0.6, 10 * TRACE_BLOCK + 50, prefix)]                              # C
    ours, oracle = new_fleet(2, a), new_fleet(3, a, shared_cache=True)
    for req, here, there in zip(reqs, (0, 0, 0, 0), (0, 1, 2, 0), strict=True):
        ours.serve(here, req)
        oracle.serve(there, req)
    assert ours.waits[3] == pytest.approx(2 * 50 * TRACE_BLOCK / a.tokens_per_s)     # behind B1 and B2
    tail = tail_breakdown(ours, oracle, range(4))
    assert tail == {"requests": 1, "queued_share": 1.0, "queued_cached_share": 1.0,
                    "queued_oracle_ttft_p50_s": pytest.approx(50 / a.tokens_per_s)}
    assert tail_breakdown(oracle, oracle, range(4)) == {"requests": 2, "queued_share": 0.0,       # B1, B2
                                                        "queued_cached_share": 0.0, "queued_oracle_ttft_p50_s": 0.0}
