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
    return LLMEngine(EngineConfig(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                  cache_memory_bytes=CACHE_BYTES))


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + 13 * j) % 500 + 10 for j in range(n)]


def prefill_seconds(engine, rid: str, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to the first token, cached tokens, and the exported state's bytes."""
    from shared.sampling_params import SamplingParams
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), export_state=True)
    while rid not in engine.held:
        engine.step()
    took = time.perf_counter() - start
    state = engine.export_state(rid)
    nbytes = sum(t.numel() * t.element_size() for t in state.to_parts()[1].values())
    cached = engine.requests[rid].num_cached_tokens
    engine.release_export(rid)
    return took, cached, nbytes


def decode_step_seconds(engine, batch: int, steps: int = 6) -> float:
    from shared.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", _prompt(64, 1000 + i), params)
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
        prefill_seconds(engine, "warm", _prompt(64, 999))                       # first-call costs
        rows, states = [], {}
        for n in lengths:
            took, _, nbytes = prefill_seconds(engine, f"p{n}", _prompt(n, n))
            rows.append([n, n / took])
            states[n] = nbytes
        longest = max(lengths)
        half = _prompt(longest, longest)[: longest // 2] + _prompt(longest // 2, 7)
        hit_s, cached, _ = prefill_seconds(engine, "hit", half)
        steps = [[b, decode_step_seconds(engine, b)] for b in batches]
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
