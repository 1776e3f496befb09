"""Measure the step costs the adaptive policy needs (`StepCosts`), on the engine that will use them.

Stand-in requests get free cache blocks and KDA slots, then the real runner times target steps at
each (batch, query length) and the real proposer times draft steps at each (batch, block); the
stand-ins are freed and nothing reaches the prefix cache, its KV events or the spec stats. Each cell
keeps the fastest of `reps` round-robin runs (the least disturbed by other work on the host). Costs depend on the
model pair, the batch bound and the machine, not on the requests, so a process measures once per
(target, draft, max batch, K) and reuses the table.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.request import Request
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.spec_decode.adaptive import StepCosts
from engine.spec_decode.proposer import DraftRequest
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_MEASURED: dict[tuple[Any, ...], StepCosts] = {}
CONTEXT_TOKENS = 32                     # context length of the stand-ins (a short chat turn)


class NoRoomToCalibrate(RuntimeError):
    """Every cache block is in use, so no stand-in request can be placed; the caller retries later."""


def grid(max_batch: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Batch sizes (powers of two up to max_batch, and it), query lengths, draft blocks to measure."""
    batches = sorted({min(2 ** i, max_batch) for i in range(max_batch.bit_length() + 1)})
    queries = sorted({q for q in (1, 2, 4, k + 1) if q <= k + 1})
    blocks = sorted({n for n in (1, (k + 1) // 2, k) if n >= 1})
    return tuple(batches), tuple(queries), tuple(blocks)


def measured_costs(engine: Any, reps: int = 3) -> StepCosts:
    """The step costs of `engine` (a SpecDecodeStep: its spec, runner, cache and proposer), memoised per
    process (see the module doc)."""
    k = engine.spec.num_speculative_tokens
    threads = getattr(engine.runner, "forward_threads", None)     # per-forward counts: key on the policy
    key = (engine.runner.identity, engine.proposer.draft_id, _max_batch(engine), k,
           threads.policy if threads is not None else torch.get_num_threads())
    if key not in _MEASURED:
        started = time.perf_counter()
        _MEASURED[key] = measure(engine, k, reps)
        log.info("adaptive speculation: step costs measured in %.1fs: %s", time.perf_counter() - started,
                 _MEASURED[key].to_dict())
    return _MEASURED[key]


def measure(engine: Any, k: int, reps: int) -> StepCosts:
    batches, queries, blocks = grid(_max_batch(engine), k)
    stand_ins = _stand_ins(engine, max(batches), CONTEXT_TOKENS + k + 1)
    try:
        for q in (1, k + 1):                                    # warm-up: first-call allocations of both paths
            _target_step(engine, stand_ins, q)
        _draft_step(engine, stand_ins, k)
        batches = tuple(sorted({b for b in batches if b < len(stand_ins)} | {len(stand_ins)}))
        cells: list[tuple[Callable[[Any, list[Request], int], None], int, int, int, int]]
        cells = [(_target_step, i, j, b, q) for i, b in enumerate(batches) for j, q in enumerate(queries)]
        cells += [(_draft_step, i, j, b, n) for i, b in enumerate(batches) for j, n in enumerate(blocks)]
        best: dict[tuple[Any, int, int], float] = {}
        for _ in range(reps):                   # round-robin: a burst of load hits different cells each round
            for fn, i, j, b, x in cells:
                seconds = _timed(fn, engine, stand_ins[:b], x)
                best[(fn, i, j)] = min(best.get((fn, i, j), seconds), seconds)
    finally:
        for req in stand_ins:
            engine.cache.free(req)
    target = [[best[(_target_step, i, j)] for j in range(len(queries))] for i in range(len(batches))]
    draft = [[best[(_draft_step, i, j)] for j in range(len(blocks))] for i in range(len(batches))]
    return StepCosts(batches, queries, lower_envelope(target), blocks, lower_envelope(draft))


def lower_envelope(table: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """cost[i][j] = the least measured at (i', j') >= (i, j): more work never costs less, and a cell a
    burst of load inflated takes the value of a larger one (a high outlier is the usual error here)."""
    rows = [[min(row[j:]) for j in range(len(row))] for row in table]
    for i in range(len(rows) - 2, -1, -1):
        rows[i] = [min(a, b) for a, b in zip(rows[i], rows[i + 1], strict=True)]
    return tuple(tuple(r) for r in rows)


def _max_batch(engine: Any) -> int:
    return engine.cache.config.num_working_slots          # = max_num_seqs


def _stand_ins(engine: Any, count: int, tokens: int) -> list[Request]:
    out = []
    for i in range(count):
        req = Request(f"_calibrate-{i}", [(7 * i + j) % 100 + 1 for j in range(CONTEXT_TOKENS + 1)],
                      SamplingParams(temperature=0.0, max_tokens=1))
        if not engine.cache.allocate(req, tokens):
            engine.cache.free(req)
            break
        out.append(req)
    if not out:
        raise NoRoomToCalibrate("adaptive speculation: no free cache room to measure step costs")
    return out


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _target_step(engine: Any, reqs: list[Request], q: int) -> None:
    drafts = tuple([1] * (q - 1))
    seqs = [ScheduledSeq(r, q, CONTEXT_TOKENS, draft_token_ids=drafts) for r in reqs]
    engine.runner.execute(SchedulerOutput(seqs))


def _draft_step(engine: Any, reqs: list[Request], n: int) -> None:
    engine.proposer.propose([DraftRequest(r.blocks, CONTEXT_TOKENS, 1, n, 0.0, 0) for r in reqs])
