"""What data parallelism with expert parallelism costs per decode step, against tensor parallelism alone.

Run: `python -m benchmarks.dp_decode_step [--model DIR] [--batches 1 8] [--steps 12] [--layouts ...]`.
Prints JSON and writes benchmarks/results/dp_decode_step.json. Each layout is a whole engine (its
ranks real processes over gloo on loopback) serving the same `batch` decode sequences; the figure is
the median and the fastest wall time of one engine step once every sequence is past its prefill (the front's step: for
DP that is every DP rank's forward or dummy step plus the front's commands and gathers). With batch 1
under DP one rank decodes and the other runs the dummy step, so that row is the dummy's price.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.core.engine import EngineConfig
from engine.parallel.dp_engine import create_engine
from shared.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "engine" / "presets_data" / "tiny-chat"
LAYOUTS = {                               # name -> EngineConfig fields
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp2-ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "dp2-ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "dp2xtp2-ep4": {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True},
}


def step_seconds(engine, batch: int, steps: int, prompt_tokens: int) -> tuple[float, float]:
    """(median, fastest) seconds of one engine step with `batch` sequences all decoding. On a shared
    machine the fastest step is the steadier figure: other load only ever adds time."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", rng.integers(0, 600, prompt_tokens).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:                        # every prompt computed, first token out
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times), min(times)


def bench(model: str, layout: str, batches: list[int], steps: int, prompt_tokens: int) -> dict:
    config = EngineConfig(model=model, max_num_seqs=max(batches), cache_memory_bytes=64 << 20,
                          **LAYOUTS[layout])  # type: ignore[arg-type]
    engine = create_engine(config)
    try:
        ms = {b: [round(1000 * t, 2) for t in step_seconds(engine, b, steps, prompt_tokens)] for b in batches}
    finally:
        engine.close()
    return {"layout": layout, "processes": config.data_parallel_size * config.tensor_parallel_size,
            "ms_per_step_median_min": ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(HERE / "results" / "dp_decode_step.json"))
    args = parser.parse_args()
    rows = [bench(args.model, name, args.batches, args.steps, args.prompt_tokens) for name in args.layouts]
    result = {"model": Path(args.model).name, "steps": args.steps, "prompt_tokens": args.prompt_tokens,
              "cpus": torch.get_num_threads(), "machine": platform.machine(), "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
