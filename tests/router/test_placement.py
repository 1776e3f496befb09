from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest

from router.placement import (
    FILTERS,
    SCORERS,
    CircuitState,
    HashKey,
    NoWorkerAvailable,
    Pipeline,
    PrefixIndex,
    RoutingContext,
    WeightedScorer,
    WorkerState,
    build_context,
    build_pipeline,
    decide_disaggregation,
    run_scorer,
)
from shared.hashing import block_hashes, root_hash
from shared.kv_events import BlockStored, KVEventBatch
from shared.openai.errors import error_from_exception
from shared.workers import LoadReport, WorkerInfo

ROOT = root_hash("m")
BS = 4
OPEN, HALF, CLOSED = CircuitState.OPEN, CircuitState.HALF_OPEN, CircuitState.CLOSED


def w(wid: str, role: str = "decode", model: str = "m", *, running: int | None = None, waiting: int = 0,
      usage: float = 0.0, inflight: int = 0, healthy: bool = True, circuit: CircuitState = CLOSED,
      draining: bool = False, reports_draining: bool = False, root: int = ROOT) -> WorkerState:
    """A worker; `running=None` means it sends no load reports."""
    load = None if running is None else LoadReport(running, waiting, cache_usage=usage, draining=reports_draining)
    info = WorkerInfo(wid, role, f"http://{wid}", model, block_size=BS, hash_root=root)  # type: ignore[arg-type]
    return WorkerState(info, load, inflight, healthy, circuit, draining)


def ctx(role: str = "decode", *, tokens: int = 16, cached: dict[str, int] | None = None,
        request_id: str = "r0", model: str = "m") -> RoutingContext:
    hashes = {HashKey(ROOT, BS): tuple(range(100, 100 + tokens // BS))}
    return RoutingContext(request_id, model, role, tokens, hashes, cached or {})  # type: ignore[arg-type]


def ids(workers) -> list[str]:
    return [x.worker_id for x in workers]


# ------------------------------------------------------------------------------------------ filters
FLEET = [w("p", "prefill"), w("d", "decode"), w("b", "both"), w("x", "decode", model="other")]
FILTER_CASES = [
    # name, config, context, workers, kept ids (input order)
    ("role", {}, ctx("decode"), FLEET, ["d", "b", "x"]),
    ("role", {}, ctx("prefill"), FLEET, ["p", "b"]),
    ("role", {}, ctx("both"), FLEET, ["b"]),
    ("model", {}, ctx(), FLEET, ["p", "d", "b"]),
    ("model", {}, ctx(model="other"), FLEET, ["x"]),
    ("healthy", {}, ctx(), [w("a"), w("u", healthy=False)], ["a"]),
    ("circuit-not-open", {}, ctx(),
     [w("c"), w("o", circuit=OPEN), w("h", circuit=HALF), w("hb", circuit=HALF, inflight=1)], ["c", "h"]),
    ("not-draining", {}, ctx(), [w("a"), w("dr", draining=True), w("rd", running=0, reports_draining=True)], ["a"]),
    ("not-overloaded", {}, ctx(), [w("a", running=0), w("b", running=8), w("c", running=9)], ["a", "b"]),
    ("not-overloaded", {}, ctx(), [w("a", running=20), w("b", running=29), w("c", running=31)], ["a", "b"]),
    ("not-overloaded", {}, ctx(), [w("a", inflight=2), w("b", inflight=30)], ["a"]),
    ("not-overloaded", {"abs_margin": 40}, ctx(), [w("a", inflight=2), w("b", inflight=30)], ["a", "b"]),
    ("not-overloaded", {}, ctx(), [w("a", running=0, waiting=5), w("b", running=0, inflight=50)], ["a"]),
    ("not-overloaded", {}, ctx(), [], []),
]


@pytest.mark.parametrize("name,config,context,workers,expected", FILTER_CASES)
def test_filters(name, config, context, workers, expected):
    assert ids(FILTERS.build(name, **config)(context, workers)) == expected


def test_registry_rejects_unknown_names_and_keys():
    with pytest.raises(ValueError, match="unknown filter 'nope'"):
        FILTERS.build("nope")
    with pytest.raises(ValueError, match="unknown config keys"):
        SCORERS.build("load", head_room=3)
    with pytest.raises(ValueError, match="rel_factor"):
        FILTERS.build("not-overloaded", rel_factor=0.5)


# ------------------------------------------------------------------------------------------ scorers
OTHER_ROOT = w("z", root=root_hash("other"))
SCORER_CASES = [
    # name, config, context, workers, expected clamped scores
    ("prefix", {}, ctx(cached={"a": 4, "b": 2}), [w("a"), w("b"), w("c")], [1.0, 0.5, 0.0]),
    ("prefix", {}, ctx(cached={"a": 9}), [w("a")], [1.0]),                 # more than the prompt: capped
    ("prefix", {}, ctx(cached={"z": 4}), [OTHER_ROOT], [0.0]),             # other hash chain: no hashes
    ("prefix", {}, ctx(tokens=3, cached={"a": 1}), [w("a")], [0.0]),       # no full block
    ("load", {}, ctx(), [w("a"), w("b", running=0)], [1.0, 1.0]),          # idle fleet
    ("load", {}, ctx(), [w("a", running=0), w("b", running=4)], [1.0, 0.5]),
    ("load", {}, ctx(), [w("a", running=2), w("b", running=3, waiting=3)], [0.8, 0.4]),
    ("load", {}, ctx(), [w("a", running=1, inflight=2), w("b", inflight=6)], [0.8, 0.4]),  # max(engine, local)
    ("load", {"headroom": 1.0}, ctx(), [w("a", inflight=1), w("b", inflight=0)], [0.5, 1.0]),
    ("load", {}, ctx(), [w("a", inflight=-3)], [1.0]),                     # bogus counter: clamped
    ("kv_usage", {}, ctx(), [w("a", running=0, usage=0.25), w("b", running=0, usage=0.75)], [0.75, 0.25]),
    ("kv_usage", {}, ctx(), [w("a", running=0, usage=0.25), w("b", running=0, usage=0.75), w("c")],
     [0.75, 0.25, 0.5]),                                                   # no report: fleet mean
    ("kv_usage", {}, ctx(), [w("a"), w("b")], [1.0, 1.0]),
    ("kv_usage", {}, ctx(), [w("a", running=0, usage=1.5), w("b", running=0, usage=-0.5)], [0.0, 1.0]),
    ("kv_usage", {}, ctx(), [w("a", running=0, usage=float("nan"))], [0.0]),
]


@pytest.mark.parametrize("name,config,context,workers,expected", SCORER_CASES)
def test_scorers(name, config, context, workers, expected):
    assert run_scorer(SCORERS.build(name, **config), context, workers) == pytest.approx(expected)


def test_run_scorer_rejects_wrong_length():
    class Broken:
        name = "broken"

        def __call__(self, ctx, workers):
            return [1.0]

    with pytest.raises(ValueError, match="returned 1 scores for 2 workers"):
        run_scorer(Broken(), ctx(), [w("a"), w("b")])


# ------------------------------------------------------------------------------------------ pipeline
def pick(workers, context=None, **kwargs) -> str:
    return build_pipeline(**kwargs).pick(context or ctx(), workers).worker.worker_id


def test_prefix_wins_when_loads_equal():
    fleet = [w("a", running=2, usage=0.3), w("b", running=2, usage=0.3), w("c", running=2, usage=0.3)]
    assert pick(fleet, ctx(cached={"b": 4, "c": 1})) == "b"


def test_load_beats_partial_hit_on_busy_worker():
    # a: 0.5 + (1 - 8/12) = 0.83 ; b: 0 + 1 = 1.0 (kv equal)
    assert pick([w("a", running=8), w("b", running=0)], ctx(cached={"a": 2})) == "b"


def test_death_spiral_guard_hot_worker_loses_despite_full_hit():
    fleet = [w("hot", running=48, waiting=16, usage=0.5), w("cold", running=0, usage=0.5)]
    context = ctx(cached={"hot": 4})
    assert pick(fleet, context) == "cold"
    # the guard is what decides: the weighted sum alone would still feed the hot worker
    no_guard = ["model", "role", "healthy", "circuit-not-open", "not-draining"]
    assert pick(fleet, context, filters=no_guard) == "hot"


def test_death_spiral_guard_with_router_local_counts_only():
    assert pick([w("hot", inflight=20), w("cold")], ctx(cached={"hot": 4})) == "cold"


def test_ties_spread_over_workers_by_request_id():
    fleet = [w(f"w{i}", running=0) for i in range(4)]
    picks = Counter(pick(fleet, ctx(request_id=f"req-{n}")) for n in range(400))
    assert set(picks) == {"w0", "w1", "w2", "w3"} and min(picks.values()) >= 60
    for n in range(20):                                   # deterministic, independent of input order
        context = ctx(request_id=f"req-{n}")
        assert len({pick(list(order), context) for order in itertools.permutations(fleet)}) == 1


def test_ties_go_to_least_loaded_first():
    fleet = [w("busy", running=3), w("idle", running=1)]
    picks = {pick(fleet, ctx(request_id=f"r{n}"), scorers={"prefix": 1.0}) for n in range(50)}
    assert picks == {"idle"}


def test_when_every_candidate_fails_its_health_checks_the_least_bad_is_tried():
    """Issue 11: probes timing out under load must not turn into 503s; open circuits still exclude."""
    assert pick([w("a", healthy=False, running=3), w("b", healthy=False, running=1)], ctx()) == "b"
    assert pick([w("a", healthy=False), w("b", healthy=False, circuit=OPEN)], ctx()) == "a"
    with pytest.raises(NoWorkerAvailable):
        build_pipeline().pick(ctx(), [w("a", healthy=False, circuit=OPEN)])


def test_excluded_workers_are_never_picked():
    bad = [w("drained", draining=True), w("sick", healthy=False), w("open", circuit=OPEN),
           w("leaving", running=0, reports_draining=True), w("prefill", "prefill")]
    good = w("good", running=6, usage=0.9)
    cached = {x.worker_id: 4 for x in bad}
    assert {pick(bad + [good], ctx(cached=cached, request_id=f"r{n}")) for n in range(50)} == {"good"}


@pytest.mark.parametrize("workers,context,filter_name", [
    ([], ctx(), None),
    ([w("x", model="other")], ctx(), "model"),
    ([w("p", "prefill")], ctx("decode"), "role"),
    ([w("a", circuit=OPEN), w("b", circuit=HALF, inflight=1)], ctx(), "circuit-not-open"),
    ([w("a", draining=True)], ctx(), "not-draining"),
])
def test_no_worker_available_says_which_filter(workers, context, filter_name):
    with pytest.raises(NoWorkerAvailable) as info:
        build_pipeline().pick(context, workers)
    assert info.value.filter_name == filter_name
    why = f"filter {filter_name!r} removed" if filter_name else "no workers are registered"
    assert why in str(info.value)
    assert context.request_id in str(info.value)
    status, body = error_from_exception(info.value)              # what the client gets
    assert (status, body.error.type, body.error.code) == (503, "service_unavailable", "no_worker_available")
    assert body.error.message == str(info.value)


def test_pick_reports_per_scorer_breakdown():
    result = build_pipeline().pick(ctx(cached={"a": 2}), [w("a", running=4, usage=0.5), w("b", running=0)])
    assert result.scores["a"] == pytest.approx({"prefix": 0.5, "load": 0.5, "kv_usage": 0.5})
    assert result.scores["b"] == pytest.approx({"prefix": 0.0, "load": 1.0, "kv_usage": 1.0})
    assert result.worker.worker_id == "b" and result.total == pytest.approx(1.5)


@pytest.mark.parametrize("scorers,error", [
    ({"nope": 1.0}, "unknown scorer 'nope'"),
    ({"load": (1.0, {"bad": 1})}, "unknown config keys"),
    ({"load": -1.0}, "weight must be >= 0"),
])
def test_build_pipeline_rejects_bad_config(scorers, error):
    with pytest.raises(ValueError, match=error):
        build_pipeline(scorers=scorers)


def test_pipeline_rejects_duplicate_scorers():
    scorer = SCORERS.build("load")
    with pytest.raises(ValueError, match="once"):
        Pipeline((), (WeightedScorer(scorer, 1.0), WeightedScorer(scorer, 2.0)))


# ------------------------------------------------------------------------------ disaggregation decider
@pytest.mark.parametrize("cached_blocks,threshold,expected", [
    (0, 256, "decode-only"),          # 100 uncached < 256
    (0, 100, "prefill-decode"),       # boundary: not below the threshold
    (0, 64, "prefill-decode"),
    (20, 64, "decode-only"),          # 100 - 80 = 20 uncached
    (20, 0, "prefill-decode"),        # 0 disables skipping
    (25, 1, "prefill-decode"),        # full hit still computes 1 token
    (25, 2, "decode-only"),
])
def test_decide_disaggregation(cached_blocks, threshold, expected):
    context = ctx(tokens=100, cached={"d": cached_blocks})
    assert decide_disaggregation(context, w("d"), threshold) == expected


def test_decide_disaggregation_rejects_prefill_worker():
    with pytest.raises(ValueError, match="prefill worker"):
        decide_disaggregation(ctx(), w("p", "prefill"), 64)


# ------------------------------------------------------------------------------------ context builder
def test_build_context_hashes_per_chain_and_reads_index_once():
    tokens = list(range(10))                              # 2 full blocks of 4
    other = root_hash("m", "salted")
    fleet = [w("a"), w("b"), w("s", root=other), w("x", model="other")]
    index = PrefixIndex()
    mine = block_hashes(tokens, BS, ROOT)
    index.apply("a", KVEventBatch(0.0, [BlockStored(mine, None, tokens[:8], BS)]))
    index.apply("s", KVEventBatch(0.0, [BlockStored(mine, None, tokens[:8], BS)]))   # wrong chain for s
    index.apply("b", KVEventBatch(0.0, [BlockStored(mine[:1], None, tokens[:4], BS)]))
    context = build_context("r", tokens, fleet, index, model="m", role="decode", now=5.0)
    assert context.hashes_for(fleet[0].info) == tuple(mine)
    assert context.hashes_for(fleet[2].info) == tuple(block_hashes(tokens, BS, other)) != tuple(mine)
    assert dict(context.cached_blocks) == {"a": 2, "b": 1, "s": 0}
    assert context.num_prompt_tokens == 10 and context.uncached_tokens(fleet[0].info) == 2
    index.apply("b", KVEventBatch(1.0, [BlockStored(mine, None, tokens[:8], BS)]))
    assert context.cached_blocks["b"] == 1                # a snapshot: later events do not leak in


def test_context_is_immutable():
    context = ctx(cached={"a": 1})
    with pytest.raises(TypeError):
        context.cached_blocks["a"] = 2                    # type: ignore[index]
    with pytest.raises(AttributeError):
        context.now = 1.0                                 # type: ignore[misc]
    assert replace(context, role="prefill").cached_blocks == {"a": 1}


def test_a_worker_state_is_immutable_and_reads_as_before():
    state = w("a", running=2, waiting=1, inflight=1)
    with pytest.raises(AttributeError):
        state.inflight = 5                                # type: ignore[misc]
    assert (state.worker_id, state.active_requests, state.is_draining, state.backlog_s) == ("a", 3, False, 0.0)
    assert WorkerState(info=state.info, inflight=4).active_requests == 4        # keywords and defaults


def test_the_tie_break_winner_is_the_highest_rendezvous_weight():
    """`rendezvous_winner` feeds the request's part once: the same winner as hashing each pair whole."""
    from router.placement.pipeline import rendezvous, rendezvous_winner
    fleet = [w(f"http://10.0.0.{i}:8200#dp{i % 3}") for i in range(40)]
    for n in range(200):
        request_id = f"chatcmpl-{n}-ü"
        expected = max(fleet, key=lambda x: rendezvous(request_id, x.worker_id))
        assert rendezvous_winner(request_id, fleet) is expected
        assert rendezvous_winner(request_id, fleet[n % 40:n % 40 + 1]) is fleet[n % 40]


def test_uncached_tokens_is_kept_per_context_and_equals_its_formula():
    fleet = [w("a"), w("b"), w("c")]
    context = ctx(tokens=16, cached={"a": 4, "b": 1})     # 4 blocks of 4
    for _ in range(2):                                    # asked again: the kept value
        assert [context.uncached_tokens(x.info) for x in fleet] == [1, 12, 16]
    prefill = replace(context, role="prefill", cached_blocks={"a": 2})
    assert [prefill.uncached_tokens(x.info) for x in fleet] == [8, 16, 16]       # its own numbers
    assert context == replace(context)                    # the kept values are not part of its identity
