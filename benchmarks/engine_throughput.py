"""Engine decode steps against this machine's memory roofline, on a quiet host and with competitors.

Run: `python -m benchmarks.engine_throughput [--preset small] [--batch-sizes 1 8]` (about 2 minutes on a
quiet 2-core host). For each batch size B it times decode steps with B running sequences; bytes moved
per step = weights read (dense + the routed experts the measured steps chose, mean distinct per MoE
layer) + MLA latents read + KDA state read and written; over the copy bandwidth that is the fraction of
the memory roofline a step reaches. `roofline_fraction_bound` counts every expert the batch could touch
(batch x top_k, at most all), as runs before 3 Dec 2026 did: an overcount once tokens share experts.

Each OpenMP variant (`--variants`: the engine's default, libgomp's spinning default as before, one
thread) is its own engine process (benchmarks/engine_step_child.py), since libgomp reads its settings
when torch loads. The benchmark starts 0, 1 and 2 busy competitors (`yes > /dev/null`; 2 takes both
cores' worth on a 2-core host) around each measurement and stops them after it, interleaving variants
and conditions round by round. Before the first round each engine decodes untimed until it makes no new
weight copies (`warm_up`; the steps that made them are in `warmup_step_ms`), so every round times a warmed
server. Writes benchmarks/results/engine_throughput.json and a summary
table beside it (`benchmarks/results/engine_throughput_latest.md`), with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from engine.checkpoint.create import create_checkpoint

# name -> environment changes; the engine applies its own OpenMP defaults (engine/host_threads.py)
VARIANTS: dict[str, dict[str, str | None]] = {
    "default": {},                                                      # what `import engine` sets up
    # the engine before the oneDNN linears and one thread for small forwards (issue 30, 3 Dec 2026)
    "before": {"KIMI_PD_CPU_GEMM": "aten", "KIMI_PD_ONE_THREAD_BELOW_TOKENS": "0", "KIMI_PD_CPU_ROWDOT": "0"},
    "no-rowdot": {"KIMI_PD_CPU_ROWDOT": "0"},        # every row count on packed oneDNN, as before 3 Dec evening
    "no-panels": {"KIMI_PD_CPU_PANELS": "0"},        # 1-3 rows on the row-major kernel, more on oneDNN, as before
    "no-decode-ops": {"KIMI_PD_CPU_DECODE_OPS": "0"},  # KDA recurrence, AttnRes, routing on torch ops (before 4 Dec)
    "no-decode-layers": {"KIMI_PD_CPU_DECODE_LAYERS": "0"},  # decode KDA / MoE layers through Python (before 4 Dec pm)
    "aten-gemm": {"KIMI_PD_CPU_GEMM": "aten"},                         # MKL's sgemm for float linears
    "two-threads": {"KIMI_PD_ONE_THREAD_BELOW_TOKENS": "0"},           # every forward on all threads
    # libgomp's own waits (spin, then sleep), every forward on all threads
    "spin": {"KIMI_PD_OPENMP_DEFAULTS": "0", "OMP_WAIT_POLICY": None, "KIMI_PD_ONE_THREAD_BELOW_TOKENS": "0"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
    "row-major": {"KIMI_PD_CPU_GEMM": "onednn"},                       # oneDNN on the weights as stored, unpacked
}
COMPETITOR_TIMEOUT_S = 120.0     # a competitor kills itself after this, even if we die first


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


@contextmanager
def competitors(n: int) -> Iterator[None]:
    """`n` busy processes (`yes > /dev/null`, each bounded by `timeout`), stopped on exit."""
    # `timeout` passes our SIGTERM on to `yes` (a SIGKILL would orphan it, still busy)
    procs = [subprocess.Popen(["timeout", "-s", "KILL", str(COMPETITOR_TIMEOUT_S), "yes"], stdout=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        time.sleep(0.2 if n else 0.0)      # let the scheduler place them
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Child:
    """One engine process under a variant's environment."""

    def __init__(self, name: str, engine_cfg: dict[str, Any]) -> None:
        env = dict(os.environ)
        for key, value in VARIANTS[name].items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.engine_step_child", json.dumps(engine_cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"variant {self.name}: engine process exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with suppress(BrokenPipeError, RuntimeError, ValueError):
            if self.proc.poll() is None:
                self.ask(op="quit")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


WARMUP_MAX_DECODES = 8


def warm_up(children: list[Child], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Untimed decodes per variant and batch size until the engine makes no new weight copies (oneDNN's
    packed and the panel kernel's copies are made on first use; an expert's the first time two rows
    choose it), so the timed rounds measure a warmed server, whatever `--rounds`. Returns each one's
    median step ms, per variant and batch: what the first requests of a fresh server pay."""
    out: dict[str, dict[str, list[float]]] = {}
    for child in children:
        for b in args.batch_sizes:
            seen, steps = -1, out.setdefault(child.name, {}).setdefault(str(b), [])
            for _ in range(WARMUP_MAX_DECODES):
                r = child.ask(op="decode", batch=b, steps=args.steps, prompt_tokens=args.prompt_tokens)
                steps.append(r["step_s"] * 1e3)
                if r["kept_copies"] == seen:
                    break
                seen = r["kept_copies"]
    return out


def measure(children: list[Child], args: argparse.Namespace, raw: dict[str, Any], deadline: float) -> int:
    """Rounds of (condition x variant x batch) into `raw`, the variant order rotated each round; no new
    round starts past `deadline` (one always runs). Returns the rounds done."""
    for rnd in range(args.rounds):
        if rnd and time.monotonic() > deadline:
            return rnd
        for n in args.competitors:
            with competitors(n):
                order = children[rnd % len(children):] + children[:rnd % len(children)]
                for child in order:
                    probe = child.ask(op="bandwidth")
                    raw["bandwidth"].setdefault((child.name, n), []).append(probe["bytes_per_s"])
                    for threads, rate in probe["read_bytes_per_s"].items():
                        raw[f"read_{threads}"].setdefault((child.name, n), []).append(rate)
                    for b in args.batch_sizes:
                        r = child.ask(op="decode", batch=b, steps=args.steps, prompt_tokens=args.prompt_tokens)
                        raw["steps"].setdefault((child.name, n, b), []).append(r["step_s"])
                        if r.get("experts_per_layer") is not None:
                            raw["experts"].setdefault((child.name, b), []).append(r["experts_per_layer"])
    return args.rounds


def best_per_condition(probes: dict[tuple[str, int], list[float]], competitors: list[int]) -> dict[int, float]:
    """The best rate any variant's probe saw with `n` competitors, per `n`: every variant of a condition
    is divided by the same figure."""
    return {n: max(rate for (_, m), rates in probes.items() if m == n for rate in rates) for n in competitors}


def rows(children: list[Child], raw: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per variant, competitors and batch: median step over rounds and its roofline fractions."""
    out = []
    # the host's bandwidth in a condition is the best any variant's probe saw in it (every probe tries
    # one thread and all), so every variant is divided by the same roofline
    host_bw = best_per_condition(raw["bandwidth"], args.competitors)
    # what one thread streams when it only reads: the ceiling of a step the engine runs on one thread
    read_1t = best_per_condition(raw["read_one_thread"], args.competitors)
    read_all = best_per_condition(raw["read_all_threads"], args.competitors)
    for child in children:
        quiet_bw = host_bw[0] if 0 in args.competitors else None
        for b in args.batch_sizes:
            # bytes as routed: the experts the measured steps' MoE layers chose (mean distinct per layer);
            # `bound` counts every expert the batch could touch (batch x top_k): what runs before 3 Dec
            # 2026 reported, an overcount once the batch's tokens share experts
            experts = raw["experts"].get((child.name, b))
            routed = statistics.fmean(experts) if experts else None
            moved = child.ask(op="bytes", batch=b, prompt_tokens=args.prompt_tokens, experts_per_layer=routed)["bytes"]
            bound = child.ask(op="bytes", batch=b, prompt_tokens=args.prompt_tokens)["bytes"]
            quiet_step = statistics.median(raw["steps"][(child.name, 0, b)]) if quiet_bw else None
            for n in args.competitors:
                step = statistics.median(raw["steps"][(child.name, n, b)])
                bw = host_bw[n]
                row = {"variant": child.name, "competitors": n, "batch": b, "decode_step_ms": step * 1e3,
                       "step_ms_rounds": [s * 1e3 for s in raw["steps"][(child.name, n, b)]],
                       "output_tokens_per_s": b / step, "bytes_per_step": moved, "experts_per_moe_layer": routed,
                       "bytes_per_step_bound": bound, "bandwidth_bytes_per_s": bw,
                       "roofline_fraction": moved / step / bw, "roofline_fraction_bound": bound / step / bw,
                       "read_one_thread_bytes_per_s": read_1t[n], "read_all_threads_bytes_per_s": read_all[n],
                       "fraction_of_one_thread_read": moved / step / read_1t[n]}
                if quiet_bw and quiet_step:   # against the host's quiet roofline: a competitor moves no bytes
                    row["roofline_fraction_of_quiet_bandwidth"] = moved / step / quiet_bw
                    row["roofline_fraction_bound_of_quiet_bandwidth"] = bound / step / quiet_bw
                    row["kept_of_quiet"] = quiet_step / step
                out.append(row)
    return out


def summary(result: dict[str, Any]) -> str:
    lines = [f"load average {result['loadavg_start']} -> {result['loadavg_end']}", "",
             "| variant | competitors | batch | ms/step | experts read per MoE layer | roofline (same condition) "
             "| of quiet roofline | of quiet, every touchable expert counted | kept of quiet "
             "| of one thread's read rate (same condition) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in result["decode"]:
        experts = r.get("experts_per_moe_layer")
        lines.append(f"| {r['variant']} | {r['competitors']} | {r['batch']} | {r['decode_step_ms']:.1f} | "
                     f"{'-' if experts is None else f'{experts:.1f}'} | {r['roofline_fraction']:.3f} | "
                     f"{r.get('roofline_fraction_of_quiet_bandwidth', nan):.3f} | "
                     f"{r.get('roofline_fraction_bound_of_quiet_bandwidth', nan):.3f} | "
                     f"{r.get('kept_of_quiet', nan):.2f} | {r.get('fraction_of_one_thread_read', nan):.3f} |")
    for name, per_batch in result.get("warmup_step_ms", {}).items():
        lines.append("")
        lines.append(f"warm-up ({name}), ms/step of each untimed decode until no new weight copies: "
                     + "; ".join(f"batch {b}: " + ", ".join(f"{ms:.1f}" for ms in steps)
                                 for b, steps in per_batch.items()))
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--checkpoint", default=None, help="default: checkpoints/<preset> (created if absent)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", default=["default", "spin"], choices=sorted(VARIANTS))
    parser.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2],
                        help="busy processes (`yes`) running during a measurement; 0 = none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="no new round starts after this (a busy host still ends; one round always runs)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt-tokens", type=int, default=1024, help="0: skip the prefix-hit TTFT")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks sharing the model (they share this machine's memory bandwidth)")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    return parser.parse_args()


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)         # run the `finally`s: competitors and engine processes stop


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    args = parse_args()
    ckpt = Path(args.checkpoint or f"checkpoints/{args.preset}")
    if not (ckpt / "config.json").exists():
        create_checkpoint(args.preset, ckpt)
    engine_cfg = {"model": str(ckpt), "dtype": args.dtype, "max_num_seqs": max(args.batch_sizes),
                  "max_num_batched_tokens": 4096, "cache_memory_bytes": 1 << 30, "block_size": 16,
                  "tensor_parallel_size": args.tensor_parallel_size,
                  "enable_expert_parallel": args.enable_expert_parallel}
    result: dict[str, Any] = {"preset": args.preset, "dtype": args.dtype, "cpus": os.cpu_count(),
                              "loadavg_start": loadavg(), "tensor_parallel_size": args.tensor_parallel_size,
                              "enable_expert_parallel": args.enable_expert_parallel}
    children: list[Child] = []
    try:
        children = [Child(name, engine_cfg) for name in args.variants]
        result["variants"] = {c.name: c.hello for c in children}
        raw: dict[str, Any] = {"steps": {}, "bandwidth": {}, "read_one_thread": {}, "read_all_threads": {},
                               "experts": {}}
        result["warmup_step_ms"] = warm_up(children, args)
        result["rounds"] = measure(children, args, raw, time.monotonic() + args.max_seconds)
        result["decode"] = rows(children, raw, args)
        if args.ttft_prompt_tokens:
            result["ttft"] = children[0].ask(op="ttft", prompt_tokens=args.ttft_prompt_tokens)
    finally:
        for child in children:
            child.close()
    result["loadavg_end"] = loadavg()
    text = json.dumps(result, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    out = Path(args.out)
    out.with_name(f"{out.stem}_latest{out.with_suffix('.md').suffix}").write_text(summary(result))
    print(summary(result))


if __name__ == "__main__":
    main()
