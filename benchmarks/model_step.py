"""Prefill tokens/s and decode ms/step of the Kimi-K3 model for the tiny and small presets.

Run: `python -m benchmarks.model_step [--presets tiny small] [--prompt-tokens 256] [--decode-steps 32]`.
Prints JSON and writes benchmarks/results/model_step.json. Weights are generated in memory (no
checkpoint on disk needed); timings are medians over repeats after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.checkpoint.init import init_weights
from engine.dtypes import torch_dtype
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from engine.model.sequence_runner import SequenceRunner
from engine.presets import preset_config


def build(preset: str, dtype: torch.dtype) -> KimiK3ForConditionalGeneration:
    model = KimiK3ForConditionalGeneration(preset_config(preset))
    init_weights(model, seed=0)
    return model.to(dtype).eval()


def time_prefill(model, ids: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        runner = SequenceRunner(model, ids.numel() + 1)
        start = time.perf_counter()
        runner.feed(ids, last_only=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def time_decode(model, ids: torch.Tensor, steps: int) -> float:
    runner = SequenceRunner(model, ids.numel() + steps + 1)
    runner.feed(ids, last_only=True)
    runner.feed(ids[:1], last_only=True)                          # warm-up step
    times = []
    for i in range(steps):
        start = time.perf_counter()
        runner.feed(ids[i % ids.numel(): i % ids.numel() + 1], last_only=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(preset: str, dtype_name: str, prompt_tokens: int, decode_steps: int, repeats: int) -> dict:
    model = build(preset, torch_dtype(dtype_name))
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 1024, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill_s = time_prefill(model, ids, repeats)
        decode_s = time_decode(model, ids, decode_steps)
    return {"preset": preset, "dtype": dtype_name, "params": params, "prompt_tokens": prompt_tokens,
            "prefill_seconds": prefill_s, "prefill_tokens_per_s": prompt_tokens / prefill_s,
            "decode_ms_per_step": decode_s * 1e3, "decode_context_tokens": prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/model_step.json")
    args = parser.parse_args()
    results = {"machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                           "torch": torch.__version__},
               "runs": [bench(p, args.dtype, args.prompt_tokens, args.decode_steps, args.repeats)
                        for p in args.presets]}
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
