"""What one worker costs in time: the numbers the planner sizes pools with.

Prefill speed depends on the prompt's length (attention over the whole context grows with it), so it
is a table of uncached tokens per second by prompt length; a prefix hit removes its tokens from the
work but not from the context. Decode is a table of step seconds by batch size. Moving a request's
state costs a fixed latency plus its bytes (a fixed KDA part and MLA latents per token) over the link.
Tables are interpolated linearly and extended flat (prefill) or along the last segment (decode).
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Table = tuple[tuple[float, float], ...]


def interpolate(table: Table, x: float, extend: bool = False) -> float:
    """y at x on a table sorted by x: linear between points; flat outside, or along the last
    segment past the end when `extend` (decode steps keep growing with the batch)."""
    if not table:
        raise ValueError("empty cost table")
    xs = [p[0] for p in table]
    if x <= xs[0] or len(table) == 1:
        return table[0][1]
    i = bisect_left(xs, x)
    if i == len(xs):
        if not extend:
            return table[-1][1]
        i = len(xs) - 1
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _table(rows: Sequence[Sequence[float]], name: str) -> Table:
    out = tuple(sorted((float(a), float(b)) for a, b in rows))
    if not out or any(y <= 0 or x <= 0 for x, y in out) or len({x for x, _ in out}) != len(out):
        raise ValueError(f"{name}: needs positive, distinct [x, y] rows")
    return out


@dataclass(frozen=True)
class CostModel:
    """Per-worker costs; `worker_cost` weighs a prefill against a decode worker (1.0 each: the same box)."""

    prefill_tokens_per_s: Table               # (prompt tokens, uncached tokens per second)
    decode_step_s: Table                      # (batch size, seconds per decode step)
    prefill_overhead_s: float = 0.0           # per prefill: scheduling, first sampling, the reply
    transfer_latency_s: float = 0.001         # per state moved: handshake, lease, the pull request
    transfer_bytes_per_s: float = 1e9
    state_fixed_bytes: int = 0                # KDA recurrent state: independent of length
    state_bytes_per_token: int = 0            # MLA latents
    max_batch: int = 64                       # decode slots per worker (max_num_seqs)
    cache_blocks: int = 8192                  # prefix cache per worker, in trace blocks
    block_tokens: int = 512                   # tokens per trace block
    chunk_tokens: int = 2048                  # chunked prefill budget per step on a worker that also decodes
    worker_cost: dict[str, float] = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0,
                                                                    "colocated": 1.0})
    source: str = "given"                     # where the numbers came from

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_tokens_per_s", _table(self.prefill_tokens_per_s, "prefill_tokens_per_s"))
        object.__setattr__(self, "decode_step_s", _table(self.decode_step_s, "decode_step_s"))
        if self.max_batch < 1 or self.transfer_bytes_per_s <= 0 or self.chunk_tokens < 1:
            raise ValueError("max_batch, transfer_bytes_per_s and chunk_tokens must be positive")

    def prefill_s(self, prompt_tokens: int, uncached_tokens: int) -> float:
        """Seconds to prefill `uncached_tokens` of a `prompt_tokens` prompt, alone on the worker."""
        return self.prefill_overhead_s + max(uncached_tokens, 1) / interpolate(self.prefill_tokens_per_s,
                                                                                prompt_tokens)

    def decode_step(self, batch: int) -> float:
        return interpolate(self.decode_step_s, max(batch, 1), extend=True)

    def transfer_s(self, prompt_tokens: int) -> float:
        nbytes = self.state_fixed_bytes + self.state_bytes_per_token * prompt_tokens
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    def chunk_s(self, prompt_tokens: int, chunk: int) -> float:
        """A prefill chunk inside a decode step (no per-request overhead: it rides the step)."""
        return chunk / interpolate(self.prefill_tokens_per_s, prompt_tokens)

    def cost(self, role: str, count: int) -> float:
        return self.worker_cost.get(role, 1.0) * count

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["prefill_tokens_per_s"] = [list(p) for p in self.prefill_tokens_per_s]
        out["decode_step_s"] = [list(p) for p in self.decode_step_s]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known - {"measured"})
        if unknown:
            raise ValueError(f"unknown cost fields: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def load_costs(path: Path) -> CostModel:
    return CostModel.from_json(json.loads(Path(path).read_text()))


def save_costs(costs: CostModel, path: Path, measured: dict[str, Any] | None = None) -> None:
    data = costs.to_json() | ({"measured": measured} if measured else {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def scaled_costs(costs: CostModel, speed: float) -> CostModel:
    """The same worker `speed` times faster (what-if for bigger hardware)."""
    if speed <= 0 or not math.isfinite(speed):
        raise ValueError("speed must be positive")
    return CostModel.from_json(costs.to_json() | {
        "prefill_tokens_per_s": [[x, y * speed] for x, y in costs.prefill_tokens_per_s],
        "decode_step_s": [[x, y / speed] for x, y in costs.decode_step_s]})
