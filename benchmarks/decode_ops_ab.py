"""The decode step with and without the C decode ops (engine/model/decode_ops.py), in one engine process.

Run: `python -m benchmarks.decode_ops_ab [--preset small] [--batch-sizes 1 8] [--rounds 8] [--switch ops]`
(about a minute per batch size on a 2-core host). For each batch size B one engine decodes B sequences; after
a warm-up with each setting, every round times `--steps` decode steps with the switch on and `--steps` with it
off, alternating which goes first. `--switch ops`: every C decode op (`decode_ops.set_enabled`); `--switch
layers`: only the whole-layer calls (`decode_ops.set_layers_enabled`: a decode step's KDA and MoE layers,
AttnRes with its norm), the per-operator calls on both sides. An A/B inside one process sees the same weights,
caches, memory layout and host noise on both sides, where `engine_throughput`'s processes do not; it cannot
see what a process-wide setting changes (threads, OpenMP), which that benchmark covers. Writes
`benchmarks/results/decode_ops_ab.json` (`decode_layers_ab.json` for `--switch layers`): per B, every round's
ms per step on and off, their medians and off / on; the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.engine_throughput import loadavg
from engine.checkpoint.create import create_checkpoint
from engine.core.engine import EngineConfig, LLMEngine
from engine.model import decode_ops
from shared.sampling_params import SamplingParams

RESULTS = {"ops": Path("benchmarks/results/decode_ops_ab.json"),
           "layers": Path("benchmarks/results/decode_layers_ab.json")}
SWITCHES: dict[str, Callable[[bool], None]] = {"ops": decode_ops.set_enabled, "layers": decode_ops.set_layers_enabled}


def timed_steps(engine: LLMEngine, steps: int) -> float:
    """ms per engine step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def measure(checkpoint: Path, batch: int, rounds: int, steps: int, warm_steps: int,
            prompt_tokens: int, switch: Callable[[bool], None] = decode_ops.set_enabled) -> dict[str, Any]:
    """One engine decoding `batch` sequences; rounds of on / off (order alternating); medians and off / on."""
    steps_needed = warm_steps * 2 + rounds * steps * 2 + 8
    engine = LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", max_num_seqs=max(batch, 1),
                                    max_num_batched_tokens=max(4096, batch * prompt_tokens),
                                    cache_memory_bytes=1 << 30, block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ab-{i}", [(7 * i + j) % 1000 for j in range(prompt_tokens)], params)
    engine.step()                                        # the prefill
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for setting in (True, False):
            switch(setting)
            timed_steps(engine, warm_steps)
        for r in range(rounds):
            for setting in ((True, False) if r % 2 == 0 else (False, True)):
                switch(setting)
                times["on" if setting else "off"].append(timed_steps(engine, steps))
    finally:
        switch(True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"batch": batch, "ms_on": times["on"], "ms_off": times["off"], "median_ms_on": on,
            "median_ms_off": off, "off_over_on": off / on}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--checkpoint", default=None, help="default: checkpoints/<preset> (created if absent)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="decode steps per setting per round")
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="ops")
    parser.add_argument("--out", type=Path, default=None, help="default: by --switch (see above)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    checkpoint = Path(args.checkpoint or f"checkpoints/{args.preset}")
    if not checkpoint.exists():
        create_checkpoint(args.preset, checkpoint)
    result: dict[str, Any] = {"preset": args.preset, "loadavg_start": loadavg(),
                              "decode_ops_loaded": decode_ops.decode_ops() is not None,
                              "switch": args.switch, "rounds": args.rounds, "steps": args.steps,
                              "prompt_tokens": args.prompt_tokens}
    result["runs"] = [measure(checkpoint, b, args.rounds, args.steps, args.warm_steps, args.prompt_tokens,
                              SWITCHES[args.switch]) for b in args.batch_sizes]
    result["loadavg_end"] = loadavg()
    out = args.out or RESULTS[args.switch]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {result['loadavg_start']} -> {result['loadavg_end']}")
    for run in result["runs"]:
        print(f"batch {run['batch']}: {run['median_ms_on']:.1f} ms on, {run['median_ms_off']:.1f} ms off "
              f"({run['off_over_on']:.2f}x)")
    return result


if __name__ == "__main__":
    main()
