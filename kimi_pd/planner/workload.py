"""Workloads in the Mooncake trace format: one JSON object a line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (one id per 512-token block of the prompt)."""
from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512


@dataclass(frozen=True)
class Request:
    arrival: float                 # seconds from the first request
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]        # ids of the prompt's full blocks (caches hold full blocks only)


def load_trace(path: Path, limit: int | None = None, block_tokens: int = TRACE_BLOCK) -> list[Request]:
    """Requests of a trace file in arrival order; a row missing a field is an error, not a guess."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(itertools.islice(f, limit), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append((float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                             [int(h) for h in r.get("hash_ids", [])]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row: {exc}") from exc
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [Request((ts - t0) / 1000, max(inp, 1), max(out, 1), tuple(h[:inp // block_tokens]))
            for ts, inp, out, h in rows]


def span_s(reqs: Sequence[Request]) -> float:
    return max(reqs[-1].arrival - reqs[0].arrival, 1e-9) if reqs else 0.0


def at_rate(reqs: Sequence[Request], factor: float) -> list[Request]:
    """The same requests arriving `factor` times as fast (bursts and order kept)."""
    if factor <= 0:
        raise ValueError("rate factor must be positive")
    return [Request(r.arrival / factor, r.input_tokens, r.output_tokens, r.blocks) for r in reqs]


def replicated(reqs: Sequence[Request], copies: int) -> list[Request]:
    """`copies` independent tenants of the same trace at once: each copy's block ids are disjoint
    (no tenant hits another's cache) and its arrivals shifted by a fraction of the mean gap, so the
    offered load is `copies` times the trace's with the same shape."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    top = 1 + max((h for r in reqs for h in r.blocks), default=0)
    gap = span_s(reqs) / max(len(reqs), 1)
    out = [Request(r.arrival + gap * c / copies, r.input_tokens, r.output_tokens,
                   tuple(h + c * top for h in r.blocks)) for c in range(copies) for r in reqs]
    out.sort(key=lambda r: r.arrival)
    return out


def summary(reqs: Sequence[Request]) -> dict[str, float]:
    span = span_s(reqs)
    return {"requests": len(reqs), "span_s": round(span, 3),
            "requests_per_s": round(len(reqs) / span, 3),
            "input_tokens_per_s": round(sum(r.input_tokens for r in reqs) / span, 1),
            "output_tokens_per_s": round(sum(r.output_tokens for r in reqs) / span, 1),
            "mean_input_tokens": round(sum(r.input_tokens for r in reqs) / len(reqs), 1),
            "mean_output_tokens": round(sum(r.output_tokens for r in reqs) / len(reqs), 1)}
