"""`kimi-pd plan --measure`: a cost model measured on this machine with our engine.

Prefill: one prompt at a time of each length (nothing cached, then the same prompt half cached, to
check that a hit only saves its tokens). Decode: the median step with B sequences running. State:
the bytes an exported state holds at two lengths (a fixed KDA part plus MLA latents per token, fitted
on the two). Link: a loopback socket's bytes/s, as the `tcp` transport moves them. Slow on a small
machine by design: a few prompts and steps per point.
"""
from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

from kimi_pd.planner.costs import CostModel

PREFILL_LENGTHS = (128, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8)
CACHE_BYTES = 256 << 20


def _engine(model: str, max_num_seqs: int):
    from engine.core.engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  cache_memory_bytes=CACHE_BYTES, num_snapshot_slots=256))


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + 13 * j) % 500 + 10 for j in range(n)]


def first_token_seconds(engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of `prompt` alone on the engine, and its cached tokens."""
    from shared.sampling_params import SamplingParams
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return time.perf_counter() - start, out.num_cached_tokens


def state_bytes(engine, rid: str, prompt: list[int]) -> int:
    """Bytes of the state a prefill worker would hand over for `prompt`."""
    from shared.sampling_params import SamplingParams
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), export_state=True)
    while rid not in engine.held:
        engine.step()
    state = engine.export_state(rid)
    engine.release_export(rid)
    return sum(t.numel() * t.element_size() for t in state.to_parts()[1].values())


def decode_step_seconds(engine, prompts: list[list[int]], steps: int = 6) -> float:
    """Median seconds of one decode step with `prompts` (one sequence each) all past their prefill; the
    engine holds nothing afterwards. Shared with benchmarks/engine_throughput.py."""
    from shared.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{len(prompts)}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in list(engine.requests):
        engine.abort(rid)
    return statistics.median(times)


def loopback_bytes_per_s(nbytes: int = 64 << 20) -> float:
    """One socket's throughput on loopback, sender in a thread."""
    payload = bytes(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        buf, got = bytearray(1 << 20), 0
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            while got < nbytes:
                n = sock.recv_into(buf)
                if n == 0:
                    break
                got += n
        took = time.perf_counter() - start
        sender.join()
    return got / took


def measure(model: str, lengths: tuple[int, ...] = PREFILL_LENGTHS,
            batches: tuple[int, ...] = DECODE_BATCHES) -> tuple[CostModel, dict[str, Any]]:
    """The cost model of one worker serving `model` here, and the raw points it came from."""
    engine = _engine(model, max(batches))
    try:
        first_token_seconds(engine, "warm", _prompt(64, 999))                   # first-call costs
        rows = []
        for n in lengths:                                                        # median of 3 distinct prompts
            took = statistics.median(first_token_seconds(engine, f"p{n}-{k}", _prompt(n, 10 * n + k))[0]
                                     for k in range(3))
            rows.append([n, n / took])
        states = {n: state_bytes(engine, f"s{n}", _prompt(n, 7 * n + 1)) for n in (min(lengths), max(lengths))}
        longest = max(lengths)
        first_token_seconds(engine, "cold", _prompt(longest, 77))
        half = _prompt(longest, 77)[: longest // 2] + _prompt(longest - longest // 2, 78)
        hit_s, cached = first_token_seconds(engine, "hit", half)
        steps = [[b, decode_step_seconds(engine, [_prompt(64, 1000 + i) for i in range(b)])] for b in batches]
        max_batch = engine.config.max_num_seqs
    finally:
        engine.close()
    lo, hi = min(lengths), max(lengths)
    per_token = max(0, (states[hi] - states[lo]) // (hi - lo))
    costs = CostModel(prefill_tokens_per_s=tuple((a, b) for a, b in rows),
                      decode_step_s=tuple((a, b) for a, b in steps),
                      transfer_bytes_per_s=loopback_bytes_per_s(), transfer_latency_s=0.002,
                      state_fixed_bytes=max(0, states[lo] - per_token * lo), state_bytes_per_token=per_token,
                      max_batch=max_batch, cache_blocks=max(1, CACHE_BYTES // max(per_token, 1) // 512),
                      source=f"measured: {model}")
    raw = {"state_bytes": states, "half_hit": {"prompt_tokens": longest, "cached_tokens": cached, "seconds": hit_s,
                                               "uncached_tokens_per_s": (longest - cached) / hit_s}}
    return costs, raw
