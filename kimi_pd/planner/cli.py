"""`kimi-pd plan`: flags, and the run that prints the answer (JSON to --output)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kimi_pd.planner.costs import CostModel, load_costs, save_costs
from kimi_pd.planner.plan import DEFAULT_THRESHOLDS, SLO, plan
from kimi_pd.planner.workload import at_rate, load_trace, replicated, summary


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="workload: a Mooncake-format trace (JSON lines)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--rate", type=float, default=1.0, help="arrivals this many times as fast as the trace")
    p.add_argument("--copies", type=int, default=1, help="independent tenants of the trace at once (scale-up)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--costs", type=Path, help="per-worker cost model (JSON; see docs/planner.md)")
    src.add_argument("--measure", metavar="MODEL_DIR", help="measure the cost model here with the engine")
    p.add_argument("--save-costs", type=Path, help="write the measured cost model here")
    p.add_argument("--speed", type=float, default=1.0, help="workers this many times faster than the costs say")
    for name in ("ttft-p90", "ttft-p99", "tpot-p90", "tpot-p99"):
        p.add_argument(f"--{name}", type=float, default=None, help=f"SLO: {name.replace('-', ' ')} seconds")
    p.add_argument("--max-workers", type=int, default=64, help="largest pool the search tries")
    p.add_argument("--thresholds", type=int, nargs="+", default=list(DEFAULT_THRESHOLDS),
                   help="decode-only thresholds (uncached prompt tokens) to try")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the whole answer here (JSON)")


def _costs(args: argparse.Namespace) -> CostModel:
    if args.costs:
        costs = load_costs(args.costs)
    else:
        from kimi_pd.planner.measure import measure
        costs, raw = measure(args.measure)
        if args.save_costs:
            save_costs(costs, args.save_costs, measured=raw)
    if args.speed != 1.0:
        from kimi_pd.planner.costs import scaled_costs
        costs = replace(scaled_costs(costs, args.speed), source=f"{costs.source} x{args.speed}")
    return costs


def run_plan(args: argparse.Namespace) -> int:
    slo = SLO(args.ttft_p90, args.ttft_p99, args.tpot_p90, args.tpot_p99)
    if all(v is None for v in (slo.ttft_p90_s, slo.ttft_p99_s, slo.tpot_p90_s, slo.tpot_p99_s)):
        raise ValueError("give at least one SLO (--ttft-p90, --ttft-p99, --tpot-p90, --tpot-p99)")
    costs = _costs(args)
    reqs = load_trace(args.trace, args.limit, costs.block_tokens)    # the trace's blocks are the cost file's
    if args.copies > 1:
        reqs = replicated(reqs, args.copies)
    if args.rate != 1.0:
        reqs = at_rate(reqs, args.rate)
    out = {"workload": {"trace": args.trace.name, "rate": args.rate, "copies": args.copies, **summary(reqs)},
           "costs": costs.to_json(),
           **plan(reqs, costs, slo, args.max_workers, tuple(args.thresholds), args.seed)}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(headline(out))
    return 0 if out["answer"] != "infeasible" else 1


def headline(out: dict) -> str:
    pd, colo = out["disaggregated"], out["colocated"]
    lines = [f"answer: {out['answer']}"]
    if pd:
        lines.append(f"disaggregated: {pd['prefill']} prefill + {pd['decode']} decode (cost {pd['cost']:g}), "
                     f"decode-only when uncached <= {pd['threshold']} tokens; ttft p99 {pd['ttft_p99_s']:.3f} s, "
                     f"tpot p99 {pd['tpot_p99_s']:.4f} s")
    if colo:
        lines.append(f"colocated: {colo['decode']} workers (cost {colo['cost']:g}); ttft p99 "
                     f"{colo['ttft_p99_s']:.3f} s, tpot p99 {colo['tpot_p99_s']:.4f} s")
    if not pd and not colo:
        lines.append(f"no fleet of at most {out['max_workers']} workers per pool meets the SLO")
    lines.append(f"{out['simulations']} simulations")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kimi-pd plan")
    add_plan_args(parser)
    sys.exit(run_plan(parser.parse_args()))
