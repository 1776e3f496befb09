"""The work ledger, the completion scorer, the backlog filter and the heartbeat correction:
table-driven, on an injected clock."""
from __future__ import annotations

import pytest

from router.capacity import capacity_tokens_from_metrics
from router.placement import FILTERS, SCORERS, HashKey, RoutingContext, WorkerState, build_pipeline, run_scorer
from router.placement.ledger import LedgerConfig, WorkLedger
from router.placement.prefix_index import ApproximatePrefixIndex
from router.placement.scorers import expected_completion_s
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from shared.hashing import root_hash
from shared.workers import LoadReport, WorkerInfo

ROOT, BS = root_hash("m"), 4


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ledger(tps: float = 1000.0, calibrate: bool = True) -> tuple[WorkLedger, Clock]:
    clock = Clock()
    return WorkLedger(LedgerConfig(tokens_per_s=tps, calibrate=calibrate, min_leg_tokens=1), clock), clock


# ------------------------------------------------------------------------------------------- ledger
# (legs opened at t=0 as (tokens), seconds elapsed, legs settled (indexes), expected backlog in s)
BACKLOG_CASES = [
    ([], 0.0, [], 0.0),
    ([1000], 0.0, [], 1.0),
    ([1000, 500], 0.0, [], 1.5),
    ([1000, 500], 0.4, [], 1.1),         # progress on the oldest leg only
    ([1000, 500], 5.0, [], 0.5),         # the oldest overran: never below the legs behind it
    ([1000, 500], 0.0, [0], 0.5),
    ([1000, 500], 0.0, [0, 1], 0.0),
    ([0, 0], 1.0, [], 0.0),
]


@pytest.mark.parametrize("legs,elapsed,settled,expected", BACKLOG_CASES)
def test_backlog(legs, elapsed, settled, expected):
    book, clock = ledger(calibrate=False)
    handles = [book.open("w", n) for n in legs]
    for i in settled:
        book.settle(handles[i])
    clock.t += elapsed
    assert book.backlog_s("w") == pytest.approx(expected)
    assert book.backlog_s("other") == 0.0


def test_settle_is_idempotent_and_per_worker():
    book, _ = ledger(calibrate=False)
    a = book.open("a", 1000)
    book.open("b", 2000)
    book.settle(a)
    book.settle(a)
    assert (book.backlog_s("a"), book.backlog_s("b"), book.open_legs("a"), book.open_legs("b")) == (0.0, 2.0, 0, 1)
    book.forget("b")
    assert book.backlog_s("b") == 0.0


def test_speed_calibrates_from_fifo_answers_whatever_the_guess():
    book, clock = ledger(tps=1000.0)               # the worker really does 4000 tokens/s
    for _ in range(20):
        legs = [book.open("w", n) for n in (4000, 2000, 8000)]
        for leg in legs:                            # FIFO: each answer arrives when its work is done
            clock.t += leg.tokens / 4000
            book.settle(leg)
    assert book.tokens_per_s("w") == pytest.approx(4000, rel=1e-6)
    assert book.tokens_per_s("never-seen") == 1000.0


def test_failed_or_cancelled_legs_do_not_calibrate():
    book, clock = ledger(tps=1000.0)
    leg = book.open("w", 5000)
    clock.t += 0.001
    book.settle(leg, calibrate=False)
    assert book.tokens_per_s("w") == 1000.0 and book.backlog_s("w") == 0.0


def test_short_legs_timed_by_overhead_do_not_calibrate():
    """The default config: a 130-token leg that took 0.7 s (a starved host, HTTP and scheduling)
    says nothing about per-token speed and leaves the estimate; a 4000-token leg moves it."""
    clock = Clock()
    book = WorkLedger(LedgerConfig(tokens_per_s=1000.0), clock)
    for _ in range(5):
        leg = book.open("w", 130)
        clock.t += 0.7
        book.settle(leg)
    assert book.tokens_per_s("w") == 1000.0
    leg = book.open("w", 4000)
    clock.t += 1.0
    book.settle(leg)
    assert book.tokens_per_s("w") == pytest.approx(4000.0)


def test_ledger_config_rejects_nonsense():
    with pytest.raises(ValueError):
        LedgerConfig(tokens_per_s=0)


# ------------------------------------------------------------------------------- scorer and filters
# the recent legs' long prefills: (legs as (worker, tokens) at 1000 tokens/s, window, expected tail in s)
TAIL_CASES = [
    ([("a", 1000)] * 4, 10, None),                                  # under tail_min_legs (5): not known yet
    ([("a", 1000)] * 4 + [("a", 0)] * 3, 10, None),                 # a decode leg after a transfer computes nothing
    ([("a", n) for n in range(100, 1100, 100)], 10, 1.0),           # q 0.9 of ten legs: the largest (index 9)
    ([("a", n) for n in range(100, 2100, 100)], 10, 2.0),           # only the last ten legs count
    ([("a", 5000)] + [("a", 100)] * 10, 10, 0.1),                   # a long leg drops out of the window
    ([("b", 4000)] + [("a", 100)] * 9, 10, 1.0),                    # each leg at its own worker's speed (b: 4000/s)
]


@pytest.mark.parametrize("legs,window,expected", TAIL_CASES)
def test_tail_prefill_seconds(legs, window, expected):
    book = WorkLedger(LedgerConfig(tokens_per_s=1000.0, worker_tokens_per_s=(("b", 4000.0),), tail_window=window,
                                   tail_quantile=0.9, tail_min_legs=5, calibrate=False))
    for worker, tokens in legs:
        book.settle(book.open(worker, tokens))
    assert book.tail_prefill_s() == (None if expected is None else pytest.approx(expected))


def test_ledger_tail_settings_are_checked():
    for bad in ({"tail_quantile": 0.0}, {"tail_quantile": 1.5}, {"tail_min_legs": 0},
                {"tail_window": 10, "tail_min_legs": 11}):
        with pytest.raises(ValueError):
            LedgerConfig(**bad)


def w(wid: str, *, backlog: float = 0.0, tps: float = 1000.0, running: int | None = None, inflight: int = 0,
      since: int = 0) -> WorkerState:
    load = None if running is None else LoadReport(running, 0, ts=50.0)
    info = WorkerInfo(wid, "prefill", f"http://{wid}", "m", block_size=BS, hash_root=ROOT)
    return WorkerState(info, load, inflight, since_report=since, backlog_s=backlog, tokens_per_s=tps)


def ctx(tokens: int = 1000, cached: dict[str, int] | None = None, tail: float | None = None) -> RoutingContext:
    return RoutingContext("r", "m", "prefill", tokens, {HashKey(ROOT, BS): tuple(range(tokens // BS))}, cached or {},
                          tail_prefill_s=tail)


COMPLETION_CASES = [
    # config, context, workers, expected scores: (best + floor) / (cost + floor)
    ({}, ctx(), [w("a"), w("b")], [1.0, 1.0]),
    ({}, ctx(), [w("a", backlog=0.99), w("b")], [1.01 / 2.0, 1.0]),
    ({}, ctx(cached={"a": 125}), [w("a"), w("b")], [1.0, 0.51 / 1.01]),         # 500 of 1000 tokens cached
    ({"own_weight": 4.0}, ctx(cached={"a": 125}), [w("a", backlog=1.0), w("b")], [1.0, 3.01 / 4.01]),
    ({}, ctx(cached={"a": 125}), [w("a", backlog=1.0), w("b")], [1.01 / 1.51, 1.0]),   # 1.5 s vs 1 s
    ({}, ctx(), [w("a", tps=2000.0), w("b", tps=0.0)], [0.06 / 0.51, 1.0]),     # unknown speed: the default
    ({"floor_s": 1.0}, ctx(), [w("a", backlog=1.0), w("b")], [2.0 / 3.0, 1.0]),
    # a recomputed token costs idle_own_weight on an idle fleet, own_weight on a busy one, linear between:
    # idle, a 0.5 s hit is worth 0.5 s; half busy, 8.5 x 0.5 s; all busy, 16 x 0.5 s
    ({"own_weight": 16.0, "idle_own_weight": 1.0}, ctx(cached={"a": 125}), [w("a"), w("b")], [1.0, 0.51 / 1.01]),
    ({"own_weight": 16.0, "idle_own_weight": 1.0}, ctx(cached={"a": 125}), [w("a", backlog=1.0), w("b")],
     [1.0, 5.26 / 8.51]),
    ({"own_weight": 16.0, "idle_own_weight": 1.0}, ctx(cached={"a": 125}),
     [w("a", backlog=1.0), w("b", backlog=1.0)], [1.0, 9.01 / 17.01]),
]


def test_a_slower_worker_is_not_charged_its_slowness_times_the_recompute_weight():
    """Nothing cached anywhere: `a` (1000 tokens/s, idle) finishes the 1000 tokens at 1.0 s, `b` (2000 tokens/s,
    0.6 s queued) at 1.1 s, and recomputing costs later requests the same on either. So `a` wins: the
    surcharge of 31 x 1000 tokens is priced at the fleet's mean 1500 tokens/s on both. (Priced at each worker's
    own speed it would be 31 s against 15.5 s, and b's queue would take the request.)"""
    scorer = SCORERS.build("completion", own_weight=32.0, default_tokens_per_s=20000.0)
    surcharge = 31 * 1000 / 1500
    a, b = 1.0 + surcharge, 0.6 + 0.5 + surcharge
    got = run_scorer(scorer, ctx(), [w("a", tps=1000.0), w("b", tps=2000.0, backlog=0.6)])
    assert got == pytest.approx([1.0, (a + 0.01) / (b + 0.01)])
    # the same fleet at one speed: the surcharge is the worker's own, as before
    assert expected_completion_s(ctx(), w("a"), 32.0) == pytest.approx(32.0)


@pytest.mark.parametrize("config,context,workers,expected", COMPLETION_CASES)
def test_completion_scorer(config, context, workers, expected):
    got = run_scorer(SCORERS.build("completion", **{"default_tokens_per_s": 20000.0, **config}), context, workers)
    assert got == pytest.approx(expected)


FILTER_CASES = [
    ("not-backlogged", {"slack_s": 2.0}, [w("a", backlog=0.5), w("b", backlog=2.5), w("c", backlog=2.6)], ["a", "b"]),
    ("not-backlogged", {"slack_s": 0.0}, [w("a", backlog=3.0), w("b", backlog=3.0)], ["a", "b"]),
    ("not-backlogged", {}, [], []),
    # with_request: the request's own compute counts (1000 tokens: 1 s at 1000 tokens/s, 0.5 s at 2000)
    ("not-backlogged", {"slack_s": 0.5}, [w("a", backlog=0.5), w("b", backlog=1.2, tps=2000.0)], ["a"]),
    ("not-backlogged", {"slack_s": 0.5, "with_request": True}, [w("a", backlog=0.5), w("b", backlog=1.2, tps=2000.0)],
     ["a", "b"]),
    ("not-backlogged", {"slack_s": 0.0, "with_request": True}, [w("a", backlog=0.5), w("b", backlog=0.0)], ["b"]),
    # counts of requests this replica sent are priced by the ledger; only unseen ones are guarded
    ("not-overloaded", {"unseen_only": True}, [w("a", running=20, inflight=20), w("b", running=0)], ["a", "b"]),
    ("not-overloaded", {"unseen_only": True}, [w("a", running=20, inflight=2), w("b", running=0)], ["b"]),
    ("not-overloaded", {}, [w("a", running=20, inflight=20), w("b", running=0)], ["b"]),
    # a report sampled before 15 of our requests finished: not overloaded any more
    ("not-overloaded", {}, [w("a", running=20, since=-15), w("b", running=0)], ["a", "b"]),
]


@pytest.mark.parametrize("name,config,workers,expected", FILTER_CASES)
def test_work_filters(name, config, workers, expected):
    assert [x.worker_id for x in FILTERS.build(name, **config)(ctx(), workers)] == expected


# tail_share: the slack is that share of the context's tail (when there is one), else slack_s
TAIL_SLACK_CASES = [
    ({"slack_s": 4.0, "tail_share": 0.5}, 2.0, [w("a", backlog=0.5), w("b", backlog=1.4), w("c", backlog=1.6)],
     ["a", "b"]),                                                    # slack 1 s
    ({"slack_s": 4.0, "tail_share": 0.5}, None, [w("a", backlog=0.5), w("b", backlog=1.4), w("c", backlog=1.6)],
     ["a", "b", "c"]),                                               # no tail yet: 4 s
    ({"slack_s": 4.0}, 2.0, [w("a", backlog=0.5), w("c", backlog=4.6)], ["a"]),    # no share: the tail is ignored
    ({"slack_s": 0.0, "tail_share": 2.0, "with_request": True}, 1.0,
     [w("a", backlog=0.5), w("b", backlog=2.4), w("c", backlog=2.6)], ["a", "b"]),  # completions 1.5, 3.4, 3.6 s
]


@pytest.mark.parametrize("config,tail,workers,expected", TAIL_SLACK_CASES)
def test_backlog_slack_follows_the_tail(config, tail, workers, expected):
    assert [x.worker_id for x in FILTERS.build("not-backlogged", **config)(ctx(tail=tail), workers)] == expected


def test_backlog_filter_rejects_a_negative_tail_share():
    with pytest.raises(ValueError):
        FILTERS.build("not-backlogged", tail_share=-0.1)


def test_router_policy_waits_for_a_hit_but_not_without_bound():
    settings = RouterSettings(model="", static_prefill=("http://a", "http://b"))
    pipe = build_pipeline(**settings.pipeline_spec())
    context = ctx(tokens=20000, cached={"a": 4000})                 # 16k of 20k tokens cached on a
    queued = lambda s: [w("a", backlog=s, tps=20000.0), w("b", tps=20000.0)]   # noqa: E731
    assert pipe.pick(context, queued(3.0)).worker.worker_id == "a"   # 3 s queue < 32 x 0.8 s saved
    # the 4 s slack bounds what the client waits: a finishes at 4.7 s against b's 1 s, 3.7 s behind
    assert pipe.pick(context, queued(4.5)).worker.worker_id == "a"
    assert pipe.pick(context, queued(5.0)).worker.worker_id == "b"   # 5.2 s: beyond the slack
    # once the fleet's recent long prefills are known to take 2 s, the slack is 0.8 x 2 s: a's 3.2 s is
    # 2.2 s behind b's 1 s, so the hit is not worth the wait
    tailed = ctx(tokens=20000, cached={"a": 4000}, tail=2.0)
    assert pipe.pick(tailed, queued(1.5)).worker.worker_id == "a"    # 1.7 s: 0.7 s behind
    assert pipe.pick(tailed, queued(3.0)).worker.worker_id == "b"


def test_backlog_filter_with_request_lets_a_prefix_holder_be_as_far_behind_as_its_hit_saves():
    context = ctx(tokens=1000, cached={"a": 250})                   # all 1000 tokens cached on a (1 left)
    fleet = [w("a", backlog=0.9), w("b")]                            # b idle, but 1 s of compute there
    by_queue = FILTERS.build("not-backlogged", slack_s=0.5)(context, fleet)
    by_completion = FILTERS.build("not-backlogged", slack_s=0.5, with_request=True)(context, fleet)
    assert [x.worker_id for x in by_queue] == ["b"]
    assert [x.worker_id for x in by_completion] == ["a", "b"]


def test_completion_rejects_an_idle_weight_above_the_busy_one():
    with pytest.raises(ValueError):
        SCORERS.build("completion", own_weight=4.0, idle_own_weight=8.0)


# ------------------------------------------------------------------------------------------ registry
def test_registry_corrects_a_stale_report_with_what_finished_since():
    clock = Clock()
    reg = WorkerRegistry(RouterSettings(model="", static_prefill=("http://a",)), None, clock=clock)
    for _ in range(6):
        reg.begin("http://a")
    reg.loads["http://a"] = LoadReport(running=6, ts=clock.t)      # the engine saw our 6
    clock.t += 0.5
    for _ in range(5):
        reg.end("http://a", ok=True)                               # 5 finish after the report
    reg.begin("http://a")                                          # and one more is sent
    state = reg.states()[0]
    assert (state.inflight, state.since_report, state.active_requests) == (2, -4, 2)
    reg.loads["http://a"] = LoadReport(running=9, ts=clock.t + 0.1)   # newer report: nothing after it
    assert reg.states()[0].active_requests == 9


def test_registry_states_carry_the_ledger():
    clock = Clock()
    reg = WorkerRegistry(RouterSettings(model="", static_prefill=("http://a",), prefill_tokens_per_s=1000.0),
                         None, clock=clock)
    reg.ledger.open("http://a", 3000)
    state = reg.states()[0]
    assert (state.backlog_s, state.tokens_per_s) == (3.0, 1000.0)


@pytest.mark.parametrize("static_tokens,expected", [(0, 65536), (8192 * 16, 8192)])
def test_static_workers_index_is_sized_from_their_cache(static_tokens, expected):
    reg = WorkerRegistry(RouterSettings(model="", static_prefill=("http://a",), block_size=16,
                                        static_cache_tokens=static_tokens), None)
    assert reg.index.approximate.capacity("http://a") == expected
    assert (reg.unsized == {"http://a"}) == (static_tokens == 0)    # else asked from its /metrics


def test_approximate_index_evicts_per_worker_capacity():
    index = ApproximatePrefixIndex(100)
    index.set_capacity("small", 3)
    index.record("small", [1, 2, 3, 4, 5])
    index.record("big", [1, 2, 3, 4, 5])
    assert (index.num_blocks("small"), index.num_blocks("big")) == (3, 5)
    assert index.matched_blocks("small", [1, 2, 3, 4, 5]) == 3     # the head survives, the tail goes first
    index.set_capacity("big", 2)
    assert index.matched_blocks("big", [1, 2, 3]) == 2


@pytest.mark.parametrize("text,expected", [
    ('# HELP x\nvllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="27798"} 1.0\n',
     27798 * 16),
    ("kimi_pd_worker_capacity_tokens 524288.0\n", 524288),
    ('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n', None),
    ("some_other_metric 3\n", None),
])
def test_capacity_from_metrics(text, expected):
    assert capacity_tokens_from_metrics(text) == expected


def test_view_reads_backlog_and_speed_as_their_own_calls_do():
    now = [100.0]
    ledger = WorkLedger(LedgerConfig(tokens_per_s=1000.0, worker_tokens_per_s=(("known", 4000.0),)),
                        clock=lambda: now[0])
    legs = [ledger.open("busy", 2000), ledger.open("busy", 500)]
    ledger.open("idle", 100)
    ledger.settle(ledger.open("idle", 300))
    for t in (100.0, 100.5, 101.0, 104.0):
        now[0] = t
        for wid in ("busy", "idle", "known", "never-seen"):
            assert ledger.view(wid) == (ledger.backlog_s(wid), ledger.tokens_per_s(wid)), (wid, t)
    ledger.settle(legs[0])
    assert ledger.view("busy") == (ledger.backlog_s("busy"), ledger.tokens_per_s("busy"))


def test_the_tail_that_bounds_a_holders_wait_is_on_the_metrics_page():
    from fastapi.testclient import TestClient

    from router.app import create_app

    def tail_line(client: TestClient) -> str:
        page = client.get("/metrics").text
        return next(line for line in page.splitlines() if line.startswith("kimi_pd_router_placement_tail_prefill"))

    settings = RouterSettings(model=None, served_model_name="m", static_prefill=("http://127.0.0.1:9",),
                              static_decode=("http://127.0.0.1:9",), prefill_tokens_per_s=1000.0)
    app = create_app(settings)
    with TestClient(app) as client:
        assert tail_line(client).endswith(" NaN")                   # no legs yet
        ledger = app.state.registry.ledger
        for tokens in range(100, 100 * (ledger.config.tail_min_legs + 1), 100):
            ledger.settle(ledger.open("http://127.0.0.1:9", tokens), calibrate=False)
        assert tail_line(client) == "kimi_pd_router_placement_tail_prefill_seconds 5.0"   # 5000 tokens at 1000/s
