"""What chosen tests of the default suite cost, this tree against an older revision, in one run.

The default suite must stay under ten minutes on two cores. This runs the same test files in a checkout
of `--base` (a temporary git worktree, removed after) and in this tree, alternately (base, this, base,
this ...), each as its own `pytest` process with one intra-op thread, and reports the wall seconds of
each run and the ratio this/base per round. Both trees must pass: a faster run that fails proves nothing.

    python -m benchmarks.suite_cost                         # results/house.json
    python -m benchmarks.suite_cost --base main --tests tests/e2e/test_lm_eval.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BASE = "d8bf07d"        # main before the second trim (ee0bc88 before the first; results/house.md has both)
# the costliest default tests the second trim changed (the moved ones ran in the base tree only), about a
# minute and a half for both trees on a quiet 2-core machine
TESTS = ("tests/e2e/test_tiny_chat.py", "tests/engine/graphs/test_static_decode.py",
         "tests/e2e/test_router_resilience.py")


@dataclass(frozen=True)
class Run:
    tree: str
    round: int
    seconds: float
    passed: bool
    summary: str


def run_tests(tree: Path, tests: list[str], timeout_s: float) -> tuple[float, bool, str]:
    """One pytest process over `tests` in `tree`: (wall seconds, passed, its last line)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = done.stdout.strip().splitlines()
    return time.monotonic() - start, done.returncode == 0, lines[-1] if lines else done.stderr[-300:]


def compare(base: str, tests: list[str], rounds: int, timeout_s: float) -> list[Run]:
    checkout = Path(tempfile.mkdtemp(prefix="kimi-pd-suite-cost-")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(checkout), base], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        runs = []
        for i in range(rounds):
            for name, tree in (("base", checkout), ("this", ROOT)):
                seconds, passed, summary = run_tests(tree, tests, timeout_s)
                runs.append(Run(name, i, round(seconds, 1), passed, summary))
                print(f"round {i} {name}: {seconds:.1f} s, {summary}", flush=True)
        return runs
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, capture_output=True)
        shutil.rmtree(checkout.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="the revision to compare with (default: before the latest trim)")
    p.add_argument("--tests", nargs="+", default=list(TESTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one pytest run may take")
    p.add_argument("--out", default=str(RESULTS / "house.json"))
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    runs = compare(args.base, args.tests, args.rounds, args.timeout)
    ratios = [this.seconds / base.seconds for base, this in zip(runs[::2], runs[1::2], strict=True)]
    report = {"base": args.base, "tests": args.tests, "runs": [asdict(r) for r in runs],
              "ratio_this_over_base": [round(r, 3) for r in ratios], "load_avg_start": load_start,
              "load_avg_end": os.getloadavg(), "cores": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ratio_this_over_base", "load_avg_start", "load_avg_end")}))
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
