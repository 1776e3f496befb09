"""The planner's pure parts, table-driven: cost tables, the search, SLO checks, the simulation on
cases with known answers, and the plan on a small synthetic trace shipped with the tests."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kimi_pd.cli import main
from kimi_pd.planner.costs import CostModel, interpolate, load_costs, save_costs, scaled_costs
from kimi_pd.planner.plan import SLO, chunk_options, lower_bounds, plan, smallest, verdict
from kimi_pd.planner.simulate import Fleet, percentile, simulate
from kimi_pd.planner.workload import Request, at_rate, load_trace, replicated, span_s

TRACE = Path(__file__).parent / "data" / "mooncake_small.jsonl"
COSTS = CostModel(prefill_tokens_per_s=((512, 10000.0), (8192, 5000.0)), decode_step_s=((1, 0.01), (32, 0.02)),
                  transfer_latency_s=0.001, transfer_bytes_per_s=1e8, state_fixed_bytes=1000,
                  state_bytes_per_token=1000, max_batch=32, cache_blocks=64, chunk_tokens=1024)


@pytest.mark.parametrize(("table", "x", "extend", "want"), [
    (((1, 2.0),), 5, False, 2.0),
    (((1, 2.0), (3, 4.0)), 0, False, 2.0),
    (((1, 2.0), (3, 4.0)), 2, False, 3.0),
    (((1, 2.0), (3, 4.0)), 3, False, 4.0),
    (((1, 2.0), (3, 4.0)), 5, False, 4.0),
    (((1, 2.0), (3, 4.0)), 5, True, 6.0),
    (((1, 1.0), (2, 2.0), (4, 2.0)), 3, False, 2.0),
])
def test_interpolate(table, x, extend, want):
    assert interpolate(table, x, extend) == pytest.approx(want)


@pytest.mark.parametrize(("first_ok", "lo", "hi", "want"), [
    (1, 1, 64, 1), (5, 1, 64, 5), (64, 1, 64, 64), (65, 1, 64, None), (3, 4, 64, 4), (33, 1, 40, 33), (9, 10, 9, None),
])
def test_smallest_finds_the_first_true_of_a_monotone_predicate(first_ok, lo, hi, want):
    calls: list[int] = []

    def ok(n: int) -> bool:
        calls.append(n)
        return n >= first_ok

    assert smallest(ok, lo, hi) == want
    assert len(calls) <= 2 * math.ceil(math.log2(hi + 1)) + 2
    assert all(lo <= n <= hi for n in calls)


@pytest.mark.parametrize(("slo", "result", "misses"), [
    (SLO(ttft_p99_s=1.0), {"ttft_p99_s": 0.9}, []),
    (SLO(ttft_p99_s=1.0), {"ttft_p99_s": 1.1}, ["ttft_p99_s"]),
    (SLO(ttft_p90_s=1.0, tpot_p99_s=0.05), {"ttft_p90_s": 2.0, "tpot_p99_s": 0.06}, ["ttft_p90_s", "tpot_p99_s"]),
    (SLO(tpot_p90_s=0.05), {"tpot_p90_s": math.nan}, []),        # no multi-token request: nothing to miss
    (SLO(), {"ttft_p99_s": 100.0}, []),
])
def test_slo_misses(slo, result, misses):
    assert [m.split()[0] for m in slo.misses(result)] == misses
    assert slo.met(result) == (not misses)


@pytest.mark.parametrize(("values", "q", "want"), [([3, 1, 2], 0.5, 2), ([1, 2, 3, 4], 0.99, 4), ([5], 0.9, 5),
                                                   (list(range(1, 101)), 0.9, 90)])
def test_percentile_is_nearest_rank(values, q, want):
    assert percentile(values, q) == want


def test_cost_model_formulas_and_file_round_trip(tmp_path):
    assert COSTS.prefill_s(512, 512) == pytest.approx(512 / 10000)
    assert COSTS.prefill_s(8192, 1024) == pytest.approx(1024 / 5000)     # a hit saves tokens, not context
    assert COSTS.decode_step(64) == pytest.approx(0.02 + 32 * (0.01 / 31))  # past the table: along the last segment
    assert COSTS.transfer_s(1000) == pytest.approx(0.001 + 1_001_000 / 1e8)
    save_costs(COSTS, tmp_path / "c.json", measured={"note": 1})
    assert load_costs(tmp_path / "c.json") == COSTS
    faster = scaled_costs(COSTS, 2.0)
    assert faster.prefill_s(512, 512) == pytest.approx(COSTS.prefill_s(512, 512) / 2)
    assert faster.decode_step(1) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="unknown cost fields: bogus"):
        CostModel.from_json(COSTS.to_json() | {"bogus": 1})
    with pytest.raises(ValueError, match="decode_step_s"):
        CostModel(prefill_tokens_per_s=((1, 1.0),), decode_step_s=())


def test_trace_loading_and_scaling(tmp_path):
    reqs = load_trace(TRACE)
    assert len(reqs) == 160 and reqs[0].arrival == 0.0
    assert all(len(r.blocks) == r.input_tokens // 512 for r in reqs)
    fast = at_rate(reqs, 4.0)
    assert span_s(fast) == pytest.approx(span_s(reqs) / 4)
    two = replicated(reqs, 2)
    assert len(two) == 320 and [r.arrival for r in two] == sorted(r.arrival for r in two)
    first, second = ({h for r in two[i::2] for h in r.blocks} for i in (0, 1))
    assert sum(r.input_tokens for r in two) == 2 * sum(r.input_tokens for r in reqs)
    assert len(first | second) == 2 * len({h for r in reqs for h in r.blocks})   # tenants share no block
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(bad)


@pytest.mark.parametrize(("fleet", "ttft", "tpot"), [
    # P/D: prefill alone, the state moves, the decode worker is idle: first token when it lands
    (Fleet(1, 1), 2048 / (10000 - 5000 * 1536 / 7680) + 0.001 + 2_049_000 / 1e8, 0.01),
    # colocated: two chunks of 1024 tokens, nothing decoding yet
    (Fleet(0, 1), 2048 / (10000 - 5000 * 1536 / 7680), 0.01),
    # decode-only under a threshold above the prompt: the same as colocated
    (Fleet(1, 1, threshold=4096), 2048 / (10000 - 5000 * 1536 / 7680), 0.01),
])
def test_one_request_on_an_idle_fleet(fleet, ttft, tpot):
    req = Request(0.0, 2048, 11, (1, 2, 3, 4))
    out = simulate([req], fleet, COSTS)
    assert out["ttft_p99_s"] == pytest.approx(ttft)
    assert out["tpot_p99_s"] == pytest.approx(tpot)
    assert out["decode_only_ratio"] == (1.0 if fleet.threshold else 0.0)


def test_batching_and_prefill_interference():
    """Two requests together decode as a batch of two; a prompt prefilled on a decoding worker
    lengthens the steps of what it decodes meanwhile (its chunk rides each step)."""
    reqs = [Request(0.0, 512, 101, ()), Request(0.0, 512, 101, ())]
    both = simulate(reqs, Fleet(2, 1), COSTS)           # two prefill workers: both land at once
    assert both["tpot_p50_s"] == both["tpot_p99_s"] == pytest.approx(COSTS.decode_step(2))
    busy = [Request(0.0, 512, 201, ()), Request(0.5, 8192, 2, ())]
    alone = simulate(busy[:1], Fleet(0, 1), COSTS)["tpot_p99_s"]
    shared = simulate(busy, Fleet(0, 1), COSTS)
    assert shared["tpot_p99_s"] > alone * 1.5
    assert simulate(busy, Fleet(1, 1), COSTS)["tpot_p99_s"] < alone * 1.1


def test_more_workers_never_hurt_on_the_trace():
    reqs = at_rate(load_trace(TRACE), 3.0)
    p99 = [simulate(reqs, Fleet(p, 4), COSTS)["ttft_p99_s"] for p in (1, 2, 4)]
    assert p99[0] > p99[1] >= p99[2]
    tpot = [simulate(reqs, Fleet(4, d), replace_batch(COSTS, 4))["tpot_p99_s"] for d in (1, 2, 4)]
    assert tpot[0] > tpot[1] >= tpot[2]


def replace_batch(costs: CostModel, n: int) -> CostModel:
    return CostModel.from_json(costs.to_json() | {"max_batch": n})


@pytest.mark.parametrize(("pd", "colo", "want"), [
    (None, None, "infeasible"),
    ({"cost": 5, "ttft_p99_s": 1.0}, None, "disaggregated"),
    (None, {"cost": 5, "ttft_p99_s": 1.0}, "colocated"),
    ({"cost": 4, "ttft_p99_s": 9.0}, {"cost": 5, "ttft_p99_s": 1.0}, "disaggregated"),
    ({"cost": 6, "ttft_p99_s": 0.1}, {"cost": 5, "ttft_p99_s": 1.0}, "colocated"),
    ({"cost": 5, "ttft_p99_s": 0.5}, {"cost": 5, "ttft_p99_s": 1.0}, "disaggregated"),
    ({"cost": 5, "ttft_p99_s": 2.0}, {"cost": 5, "ttft_p99_s": 1.0}, "colocated"),
])
def test_verdict(pd, colo, want):
    assert verdict(pd, colo) == want


@pytest.mark.parametrize(("chunk", "want"), [(2048, (2048, 512)), (1024, (1024, 256)), (512, (512, 256)),
                                             (128, (256, 128))])
def test_colocated_gets_smaller_chunk_budgets_tried(chunk, want):
    assert chunk_options(CostModel.from_json(COSTS.to_json() | {"chunk_tokens": chunk})) == want


def test_lower_bounds():
    reqs = [Request(float(t), 50_000, 33, ()) for t in range(11)]      # 10 s span; each prefill alone: 10 s
    assert lower_bounds(reqs, COSTS) == (11, 1)
    long = [Request(float(t), 512, 32 * 1000, ()) for t in range(11)]   # 352,000 tokens at 32 per 0.02 s step
    assert lower_bounds(long, COSTS) == (1, 22)


def test_plan_is_minimal_and_meets_the_slo():
    reqs = at_rate(load_trace(TRACE), 3.0)
    slo = SLO(ttft_p99_s=1.5, tpot_p99_s=0.03)
    out = plan(reqs, COSTS, slo, max_workers=16, thresholds=(0, 1024))
    pd = out["disaggregated"]
    assert out["answer"] in ("disaggregated", "colocated") and pd is not None
    fleet = Fleet(pd["prefill"], pd["decode"], pd["threshold"])
    assert slo.met(simulate(reqs, fleet, COSTS))
    for fewer in (Fleet(fleet.prefill - 1, fleet.decode, fleet.threshold),
                  Fleet(fleet.prefill, fleet.decode - 1, fleet.threshold)):
        if fewer.prefill >= 1 and fewer.decode >= 1:
            assert not slo.met(simulate(reqs, fewer, COSTS)), f"{fewer} is cheaper and also meets the SLO"
    colo = out["colocated"]
    cheaper = "disaggregated" if colo is None or pd["cost"] < colo["cost"] else out["answer"]
    assert out["answer"] == cheaper


def test_plan_reports_infeasible_when_no_fleet_can():
    reqs = load_trace(TRACE)
    out = plan(reqs, COSTS, SLO(ttft_p99_s=0.001), max_workers=4, thresholds=(0,))
    assert out["answer"] == "infeasible" and out["disaggregated"] is None and out["colocated"] is None


def test_kimi_pd_plan_command(tmp_path, capsys):
    save_costs(COSTS, tmp_path / "costs.json")
    rc = main(["plan", "--trace", str(TRACE), "--costs", str(tmp_path / "costs.json"), "--ttft-p99", "2",
               "--tpot-p99", "0.03", "--max-workers", "8", "--thresholds", "0", "--output", str(tmp_path / "p.json")])
    assert rc == 0
    out = json.loads((tmp_path / "p.json").read_text())
    assert out["workload"]["requests"] == 160 and out["answer"] in ("disaggregated", "colocated")
    pd = out["disaggregated"]
    assert f"{pd['prefill']} prefill + {pd['decode']} decode" in capsys.readouterr().out
    assert main(["plan", "--trace", str(TRACE), "--costs", str(tmp_path / "costs.json")]) == 2   # no SLO given


def test_measure_builds_a_cost_model_from_the_engine():
    """Small sizes (the machine is small): positive speeds and steps, the state size fitted exactly on
    its two lengths, and a half-cached prompt reporting its cached half."""
    from kimi_pd.planner.measure import measure
    model = Path(__file__).resolve().parents[2] / "engine" / "presets_data" / "tiny-chat"
    costs, raw = measure(str(model), lengths=(64, 128), batches=(1, 2))
    assert [x for x, _ in costs.prefill_tokens_per_s] == [64, 128] and all(y > 0 for _, y in costs.prefill_tokens_per_s)
    assert [x for x, _ in costs.decode_step_s] == [1, 2] and all(y > 0 for _, y in costs.decode_step_s)
    for n, nbytes in raw["state_bytes"].items():
        assert costs.state_fixed_bytes + costs.state_bytes_per_token * n == nbytes
    assert raw["half_hit"]["cached_tokens"] == 64
    assert costs.transfer_bytes_per_s > 1e6 and costs.max_batch == 2
