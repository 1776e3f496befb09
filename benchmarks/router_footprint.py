"""What a router process costs before it serves anything: import time of `router.app` and the
modules it loads, and the resident memory of `kimi-pd router` once /health answers.

Run: `python -m benchmarks.router_footprint [--rounds 5] [--tree /path/to/other/checkout ...]`.

Each tree (this checkout first, then every `--tree`, e.g. a checkout of main as the baseline) is
measured in fresh interpreters with `PYTHONPATH=<tree>`, rounds interleaved across trees so machine
load hits them alike. Per round: (1) `import router.app` timed in-process, with the number of project
modules loaded and whether torch/engine were; (2) `python -m kimi_pd router --model DIR --worker
http://127.0.0.1:1` (a static worker: no store needed), VmRSS from /proc once /health answers, and
the time until then. Medians are reported, and ratios against the last tree given. Prints JSON
and writes benchmarks/results/router_footprint.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shared.net import free_port

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("router", "shared", "engine", "worker", "kv_transfer", "prefill_worker", "decode_worker", "kimi_pd")
IMPORT_PROBE = f"""
import json, sys, time
t = time.perf_counter()
import router.app
elapsed = time.perf_counter() - t
print(json.dumps({{"import_s": elapsed, "torch": "torch" in sys.modules, "engine": "engine" in sys.modules,
                  "project_modules": sum(m.split(".")[0] in {PROJECT!r} for m in sys.modules)}}))
"""


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def measure_import(tree: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=tree, env=env_for(tree), capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure_process(tree: Path, model_dir: Path, timeout_s: float = 300.0) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "kimi_pd", "router", "--workers", "1", "--model", str(model_dir), "--port", str(port),
           "--worker", "http://127.0.0.1:1", "--log-level", "warning"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env_for(tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("router /health did not answer")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        ready_s = time.perf_counter() - start
        return {"rss_mib": vm_rss_mib(proc.pid), "ready_s": ready_s}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def summarise(samples: list[dict]) -> dict:
    keys = [k for k, v in samples[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: statistics.median(s[k] for s in samples) for k in keys}
    out.update({k: samples[0][k] for k, v in samples[0].items() if isinstance(v, bool)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_footprint", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tree", action="append", default=[], help="another checkout to measure (e.g. main)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny one, generated)")
    args = p.parse_args(argv)
    trees = [ROOT, *(Path(t).resolve() for t in args.tree)]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else None
        if model is None:
            from engine.checkpoint.create import create_checkpoint
            model = create_checkpoint("tiny", Path(tmp) / "tiny", progress=False)
        samples: dict[Path, list[dict]] = {t: [] for t in trees}
        for _ in range(args.rounds):
            for tree in trees:
                samples[tree].append({**measure_import(tree), **measure_process(tree, model)})
    results = {str(t): summarise(s) for t, s in samples.items()}
    base = results[str(trees[-1])]
    for r in results.values():
        r["vs_last_tree"] = {k: r[k] / base[k] for k in ("import_s", "rss_mib", "ready_s", "project_modules")}
    load = os.getloadavg()
    report = {"benchmark": "router_footprint", "rounds": args.rounds, "trees": results,
              "machine": {"cpus": os.cpu_count(), "load_average_1m": load[0], "python": sys.version.split()[0]}}
    text = json.dumps(report, indent=2)
    print(text)
    out = ROOT / "benchmarks" / "results" / "router_footprint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
