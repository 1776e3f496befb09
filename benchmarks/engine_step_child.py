"""One engine in its own process, answering the contention benchmark's requests on stdin/stdout.

`benchmarks/engine_throughput.py` starts one per OpenMP variant (each variant is an environment, and
libgomp reads it only when torch loads), so the variants run interleaved in one benchmark run.
Protocol: one JSON object a line each way; `{"op": "quit"}` ends it.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.core.cache_manager import bytes_per_slot
from engine.core.engine import EngineConfig, LLMEngine
from engine.host_threads import openmp_settings, process_threads
from engine.model.gemm import kept_copies
from kimi_pd.planner.measure import decode_step_seconds as measured_decode_step
from shared.sampling_params import SamplingParams


def measure_bandwidth(max_threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write counted), best of `repeats` on one thread and on
    `max_threads`: the host's bandwidth whatever the engine's own count (one thread for small forwards,
    engine/host_threads.py) was left at. Restores that count."""
    import torch  # after `engine` (its OpenMP defaults go in before torch loads)
    was = torch.get_num_threads()
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    try:
        for threads in sorted({1, max_threads}):
            torch.set_num_threads(threads)
            dst.copy_(src)
            for _ in range(repeats):
                start = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(was)
    return 2 * nbytes / min(times)


def measure_read_bandwidth(max_threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of reading a large tensor (a sum: no write stream), best of `repeats`, on one thread and
    on `max_threads`. A decode step mostly reads, and the engine runs small forwards (batch 1 and 8 of the
    small preset) on one thread: `one_thread` is what such a step could stream at most. Restores the
    thread count."""
    import torch
    was = torch.get_num_threads()
    src = torch.ones(nbytes // 4)
    best: dict[int, float] = {}
    try:
        for threads in sorted({1, max_threads}):
            torch.set_num_threads(threads)
            src.sum()
            for _ in range(repeats):
                start = time.perf_counter()
                src.sum()
                best[threads] = max(best.get(threads, 0.0), nbytes / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(was)
    return {"one_thread": best[1], "all_threads": best[max(best)]}


def weight_bytes_per_step(engine: LLMEngine, batch: int, experts_per_layer: float | None = None) -> int:
    """Dense weights + the routed experts a step reads per MoE layer: `experts_per_layer` (as routed,
    from `routed_experts`) or, when not given, the most the batch can touch (batch * top_k, at most all)."""
    cfg, model = engine.model.config.text_config, engine.model.language_model
    expert_bytes, dense = 0, 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes += n
        elif "embed_tokens" not in name:
            dense += n
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = expert_bytes / max(1, cfg.num_experts * moe_layers)
    touched = (min(cfg.num_experts, batch * cfg.num_experts_per_token) if experts_per_layer is None
               else experts_per_layer)
    return int(dense + per_expert * touched * moe_layers)


@contextmanager
def routed_experts(rows: int) -> Iterator[list[int]]:
    """Distinct routed experts of each MoE layer call on `rows` tokens, counted after the block (the
    calls only keep a reference to their expert ids, so the timed steps pay next to nothing). A layer run
    in one C call (`LatentMoE._rows_in_c`) routes in C: its input is kept, and routed again after the block
    (the router's own product, to rounding the fused one's)."""
    import torch  # after `engine` (its OpenMP defaults go in before torch loads)

    from engine.model.moe import LatentMoE, route
    seen: list[Any] = []
    in_c: list[Any] = []
    counts: list[int] = []
    real, real_rows = LatentMoE._routed_dispatch, LatentMoE._rows_in_c

    def recording(self, h, weights, ids):
        seen.append(ids)
        return real(self, h, weights, ids)

    def recording_rows(self, x):
        y = real_rows(self, x)
        if y is not None:
            in_c.append((self, x))
        return y

    LatentMoE._routed_dispatch = recording          # type: ignore[method-assign]
    LatentMoE._rows_in_c = recording_rows           # type: ignore[method-assign]
    try:
        yield counts
    finally:
        LatentMoE._routed_dispatch = real          # type: ignore[method-assign]
        LatentMoE._rows_in_c = real_rows           # type: ignore[method-assign]
        with torch.inference_mode():
            seen.extend(route(moe.gate.logits(x), moe.gate.e_score_correction_bias, moe.top_k, moe.renormalize,
                              moe.scaling)[1] for moe, x in in_c)
        counts.extend(len(set(ids.reshape(-1).tolist())) for ids in seen if ids.shape[0] == rows)


def state_bytes_per_step(engine: LLMEngine, batch: int, context: int) -> int:
    """MLA latents read + KDA state read and written, per step."""
    cfg = engine.model.config.text_config
    elt = engine.runner.dtype.itemsize
    mla = len(cfg.mla_layer_ids) * context * cfg.mla_cache_dim * elt
    return batch * (mla + 2 * bytes_per_slot(cfg, elt))


def decode(engine: LLMEngine, req: dict[str, Any]) -> float:
    """Median decode step seconds with `batch` sequences of `prompt_tokens` running."""
    prompts = [[(7 * i + j) % 1000 for j in range(req["prompt_tokens"])] for i in range(req["batch"])]
    return measured_decode_step(engine, prompts, req["steps"])


def decode_answer(engine: LLMEngine, req: dict[str, Any]) -> dict[str, Any]:
    """The median step, the routed experts its MoE layers read (mean distinct per layer and step) and the
    weights with a packed or panel copy afterwards (`engine_throughput.warm_up` waits until they stop growing)."""
    with routed_experts(req["batch"]) as counts:
        step = decode(engine, req)
    return {"step_s": step, "experts_per_layer": statistics.fmean(counts) if counts else None,
            "kept_copies": kept_copies()}


def ttft(engine: LLMEngine, prompt_tokens: int) -> dict[str, Any]:
    """Cold first token of a prompt, then the same prompt again (a prefix hit)."""
    prompt = [(13 * j) % 1000 for j in range(prompt_tokens)]
    times, cached = [], 0
    for rid in ("cold", "warm"):
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while not (outs := engine.step()):
            pass
        times.append(time.perf_counter() - start)
        cached = outs[0].num_cached_tokens
    return {"prompt_tokens": prompt_tokens, "cold_s": times[0], "prefix_hit_s": times[1],
            "cached_tokens": cached, "hit_over_cold": times[1] / times[0]}


def answer(engine: LLMEngine, req: dict[str, Any], tp: int) -> dict[str, Any]:
    op = req["op"]
    if op == "decode":
        return decode_answer(engine, req)
    if op == "bandwidth":
        return {"bytes_per_s": measure_bandwidth(process_threads()),
                "read_bytes_per_s": measure_read_bandwidth(process_threads())}
    if op == "bytes":      # TP: every rank reads its own 1/N of the sharded weights, so N x rank 0's
        return {"bytes": weight_bytes_per_step(engine, req["batch"], req.get("experts_per_layer")) * tp
                + state_bytes_per_step(engine, req["batch"], req["prompt_tokens"])}
    if op == "ttft":
        return ttft(engine, req["prompt_tokens"])
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    eng = LLMEngine(EngineConfig(**cfg))
    hello = {"threads": process_threads(), "openmp": openmp_settings()}
    print(json.dumps(hello), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "quit":
                break
            print(json.dumps(answer(eng, req, cfg.get("tensor_parallel_size", 1))), flush=True)
    finally:
        eng.close()


if __name__ == "__main__":
    main()
