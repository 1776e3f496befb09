"""The planner's answer on the Mooncake traces, checked against the router's real placement, and at
64-512 workers on the traces scaled up.

Run: `python -m benchmarks.planner_scale [--costs benchmarks/planner_reference_costs.json]
[--copies 8 32 64] [--limit 200] [--skip-scale]`.

Check (`check`): for each trace at its own rate, `plan()` sizes the fleet for the SLO; then the same
trace goes through the router's registry and placement pipeline (benchmarks.placement_replay) on the
planned number of prefill workers, each a FIFO server at the cost model's speed for the trace's mean
prompt; the router's prefill p99 plus the p99 state transfer and one decode step must stay within
the TTFT target, i.e. the plan also holds under the router's own placement, not only the planner's.
Scale (`scale`): the first `--limit` requests of the conversation trace as `copies` independent tenants
(disjoint prefixes, arrivals interleaved), planned with `--max-workers 1024`; reported: the pools, the
verdict, the simulations it took and their wall time. Traces are read from ../shared/data/mooncake
relative to the repository (or --trace-dir); absent, the run stops with a message.
JSON to benchmarks/results/planner_scale.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.placement_replay import Request as ReplayRequest
from benchmarks.placement_replay import router_settings, run_router
from kimi_pd.planner.costs import CostModel, interpolate, load_costs
from kimi_pd.planner.plan import SLO, plan
from kimi_pd.planner.simulate import percentile
from kimi_pd.planner.workload import Request, load_trace, replicated, summary

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "data" / "mooncake"
RESULTS = ROOT / "benchmarks" / "results" / "planner_scale.json"
COSTS = ROOT / "benchmarks" / "planner_reference_costs.json"


def replay_check(reqs: list[Request], answer: dict[str, Any], costs: CostModel, slo: SLO) -> dict[str, Any]:
    """The planned prefill pool under the router's own placement (prefill legs only)."""
    pd = answer["disaggregated"]
    if pd is None:
        return {"skipped": "no disaggregated plan"}
    speed = interpolate(costs.prefill_tokens_per_s, statistics.fmean(r.input_tokens for r in reqs))
    args = argparse.Namespace(cache_blocks=costs.cache_blocks, tokens_per_s=speed, heartbeat_s=1.0,
                              report_delay_s=0.25, scorers=None)
    replay = [ReplayRequest(r.arrival, r.input_tokens, r.blocks) for r in reqs]
    got = run_router(replay, pd["prefill"], args, router_settings(pd["prefill"], args, legacy=False))
    extra = percentile([costs.transfer_s(r.input_tokens) for r in reqs], 0.99) + costs.decode_step(pd["decode"])
    ttft_p99 = got["ttft_p99_s"] + extra
    limit = slo.ttft_p99_s
    return {"router_prefill_ttft_p99_s": got["ttft_p99_s"], "router_hit_ratio": got["hit_ratio"],
            "transfer_p99_plus_step_s": extra, "router_ttft_p99_s": ttft_p99, "planner_ttft_p99_s": pd["ttft_p99_s"],
            "replay_tokens_per_s": speed, "slo_met": limit is None or ttft_p99 <= limit}


def one(reqs: list[Request], costs: CostModel, slo: SLO, max_workers: int, thresholds: tuple[int, ...],
        label: dict[str, Any]) -> dict[str, Any]:
    print(f"planner_scale: {label} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    answer = plan(reqs, costs, slo, max_workers, thresholds)
    took = time.perf_counter() - start
    keep = ("answer", "disaggregated", "colocated", "simulations")
    return {**label, "workload": summary(reqs), **{k: answer[k] for k in keep},
            "by_threshold": {t: f and (f["prefill"], f["decode"]) for t, f in answer["by_threshold"].items()},
            "plan_seconds": round(took, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_scale", description=__doc__.splitlines()[0])
    p.add_argument("--costs", type=Path, default=COSTS)
    p.add_argument("--trace-dir", type=Path, default=TRACES)
    p.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    p.add_argument("--copies", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--limit", type=int, default=200, help="requests of the trace per tenant in the scale runs")
    p.add_argument("--ttft-p90", type=float, default=6.0)
    p.add_argument("--ttft-p99", type=float, default=20.0, help="long-context traces: a lone 85k-token prompt "
                   "(the conversation trace's p99) takes 8 s at the reference speed")
    p.add_argument("--tpot-p99", type=float, default=0.1)
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not args.trace_dir.is_dir():
        print(f"planner_scale: no traces at {args.trace_dir} (give --trace-dir)", file=sys.stderr)
        return 2
    costs = load_costs(args.costs)
    slo = SLO(ttft_p90_s=args.ttft_p90, ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)
    checks = []
    for trace in args.traces:
        reqs = load_trace(args.trace_dir / f"{trace}_trace.jsonl")
        row = one(reqs, costs, slo, 256, (0, 1024, 4096), {"trace": trace, "copies": 1})
        row["router_replay"] = replay_check(reqs, row, costs, slo)
        checks.append(row)
    scale = []
    if not args.skip_scale:
        base = load_trace(args.trace_dir / "conversation_trace.jsonl", args.limit)
        for copies in args.copies:
            scale.append(one(replicated(base, copies), costs, slo, 1024, (0, 1024),
                             {"trace": "conversation", "copies": copies, "limit": args.limit}))
    out = {"benchmark": "planner_scale", "costs": costs.to_json(), "slo": asdict(slo), "check": checks,
           "scale": scale}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    for row in checks + scale:
        pd, colo = row["disaggregated"], row["colocated"]
        print(f"{row['trace']} x{row['copies']}: {row['answer']}; P/D {pd and (pd['prefill'], pd['decode'])} "
              f"threshold {pd and pd['threshold']}; colocated {colo and colo['decode']}; "
              f"{row['simulations']} sims in {row['plan_seconds']} s"
              + (f"; router replay SLO met: {row['router_replay'].get('slo_met')}" if "router_replay" in row else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
