"""Engine throughput vs batch size and prefix-hit TTFT, read against this machine's memory roofline.

Run: `python -m benchmarks.engine_throughput [--preset small] [--batch-sizes 1 2 4 8]`.
Writes benchmarks/results/engine_throughput.json. For each batch size B it times decode steps with
B running sequences; bytes moved per step = weights read (dense + the experts the batch can touch)
+ MLA latents read + KDA state read and written. Dividing by the measured copy bandwidth gives the
fraction of the memory roofline a step reaches (decode is memory-bound on real accelerators).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.checkpoint.create import create_checkpoint
from engine.core.cache_manager import bytes_per_slot
from engine.core.engine import EngineConfig, LLMEngine
from kimi_pd.planner.measure import decode_step_seconds as measured_decode_step
from shared.sampling_params import SamplingParams


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / min(times)


def weight_bytes_per_step(engine: LLMEngine, batch: int) -> int:
    """Dense weights + routed experts the batch can touch (at most batch * top_k per MoE layer)."""
    cfg, model = engine.model.config.text_config, engine.model.language_model
    expert_bytes, dense = 0, 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes += n
        elif "embed_tokens" not in name:
            dense += n
    per_expert = expert_bytes / max(1, cfg.num_experts * sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))
    touched = min(cfg.num_experts, batch * cfg.num_experts_per_token)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return int(dense + per_expert * touched * moe_layers)


def state_bytes_per_step(engine: LLMEngine, batch: int, context: int) -> int:
    cfg = engine.model.config.text_config
    elt = engine.runner.dtype.itemsize
    mla = len(cfg.mla_layer_ids) * context * cfg.mla_cache_dim * elt
    return batch * (mla + 2 * bytes_per_slot(cfg, elt))


def decode_step_seconds(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    prompts = [[(7 * i + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
    return measured_decode_step(engine, prompts, steps)


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        outs = engine.step()
        if outs:
            return time.perf_counter() - start, outs[0].num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--checkpoint", default=None, help="default: checkpoints/<preset> (created if absent)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks sharing the model (they share this machine's memory bandwidth)")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--unfused-baseline", action="store_true",
                        help="also time each batch with the fused linears undone (TP=1), in the same run")
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = parser.parse_args()
    ckpt = Path(args.checkpoint or f"checkpoints/{args.preset}")
    if not (ckpt / "config.json").exists():
        create_checkpoint(args.preset, ckpt)
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                                    max_num_batched_tokens=4096, cache_memory_bytes=1 << 30, block_size=16,
                                    tensor_parallel_size=args.tensor_parallel_size,
                                    enable_expert_parallel=args.enable_expert_parallel))
    bandwidth = measure_bandwidth()
    rows = []
    for b in args.batch_sizes:
        step = decode_step_seconds(engine, b, args.prompt_tokens, args.steps)
        # TP: rank 0 holds 1/N of the sharded weights and every rank reads its own, so N x rank 0's bytes
        # (an estimate under EP, where a rank's routed experts are not a 1/N sample of the touched ones).
        moved = (weight_bytes_per_step(engine, b) * args.tensor_parallel_size
                 + state_bytes_per_step(engine, b, args.prompt_tokens))
        row = {"batch": b, "decode_step_ms": step * 1e3, "output_tokens_per_s": b / step,
               "bytes_per_step": moved, "achieved_bytes_per_s": moved / step,
               "roofline_fraction": moved / step / bandwidth}
        if args.unfused_baseline and args.tensor_parallel_size == 1:
            engine.model.unfuse_linears()          # one GEMM per linear, as before engine/model/fused.py
            unfused = decode_step_seconds(engine, b, args.prompt_tokens, args.steps)
            engine.model.fuse_linears()
            row.update(unfused_decode_step_ms=unfused * 1e3, unfused_roofline_fraction=moved / unfused / bandwidth,
                       fused_over_unfused=step / unfused)
        rows.append(row)
    prompt = [(13 * j) % 1000 for j in range(args.ttft_prompt_tokens)]
    cold, _ = ttft(engine, "cold", prompt)
    warm, cached = ttft(engine, "warm", prompt)
    result = {"preset": args.preset, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "memory_bandwidth_bytes_per_s": bandwidth, "decode": rows,
              "ttft": {"prompt_tokens": len(prompt), "cold_s": cold, "prefix_hit_s": warm,
                       "cached_tokens": cached, "hit_over_cold": warm / cold}}
    result["tensor_parallel_size"] = args.tensor_parallel_size
    result["enable_expert_parallel"] = args.enable_expert_parallel
    engine.close()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
