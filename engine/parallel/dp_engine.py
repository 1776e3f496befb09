"""The front of a data-parallel engine: D engines stepping together, one API (`LLMEngine`'s).

DP rank 0's engine runs in this process; ranks 1..D-1 run in their leaders' processes (`dp_leader.py`,
here or on `--headless` nodes). Each request lives on one DP rank, picked at `add_request` by prefix
(the rank whose cache holds the most leading blocks of its prompt, from that rank's KV events), then
load (fewest live requests; idle ranks take turns); every later call about it (abort, export, release) goes to that
rank. A step is lock-step: every rank runs one forward (or the dummy step) so the routed experts'
exchanges line up, and the front gathers every rank's outputs and load. Only the front decides to
step, so an idle engine sends nothing.
"""
from __future__ import annotations

import collections
import itertools
import logging
import typing
from typing import Any

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.inputs import EngineInput
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from engine.parallel.dp_config import DPLayout
from engine.parallel.dp_rank import step_once
from shared.hashing import block_hashes, salted_root
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)
MAX_BUFFERED_EVENTS = 100_000          # remote ranks' KV events nobody drained (a snapshot repairs a gap)


def create_engine(config: EngineConfig) -> LLMEngine:
    """The engine `config` asks for: one LLMEngine, or the front of `data_parallel_size` of them (typed as
    LLMEngine: it offers the interface the servers and `LLM` use)."""
    if config.data_parallel_size > 1:
        return typing.cast(LLMEngine, DataParallelEngine(config))
    return LLMEngine(config)


class DataParallelEngine:
    """LLMEngine's interface over D data-parallel engines (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.parallel.launch import start_data_parallel
        config.validate()
        self.layout = DPLayout.of(config)
        handle, self.channel = start_data_parallel(config)
        try:
            self.local = LLMEngine(config, parallel=handle)
        except BaseException:
            handle.close(0.0)
            raise
        self.config, self.tp = config, handle
        for name in ("tokenizer", "model", "grammars", "identity", "max_model_len", "spec", "spec_stats",
                     "cache_config", "hash_root", "eos_token_ids"):
            setattr(self, name, getattr(self.local, name))
        size = self.layout.size
        self.placement: dict[str, int] = {}                      # request id -> its DP rank (live or held)
        self.live: list[set[str]] = [set() for _ in range(size)]
        self.loads: list[dict[str, Any]] = [{"running": 0, "waiting": 0, "preemptions": 0, "usage": 0.0}] * size
        self.exports: set[str] = set()                           # added with export_state: held when finished
        self.placed = [0] * size                                 # requests each DP rank was given
        self.remote_hashes: list[set[int]] = [set() for _ in range(size)]
        self.events: collections.deque = collections.deque(maxlen=MAX_BUFFERED_EVENTS)
        self.scheduler, self.cache = _SchedulerView(self), _CacheView(self)
        self._ids = itertools.count()
        self._closed = False

    def check_integrity(self) -> None:
        """Every DP rank's cache and request bookkeeping checks (raises on the first broken rank)."""
        for d in range(self.layout.size):
            self._on(d, "check_integrity", ())

    def step_counts(self) -> list[tuple[int, int]]:
        """(forwards, dummy steps) of every DP rank, as of the last step."""
        runner: Any = self.local.runner
        return [(runner.forwards, runner.dummies)] + [(r.get("forwards", 0), r.get("dummies", 0))
                                                      for r in self.loads[1:]]

    def data_parallel_stats(self) -> dict[str, Any]:
        """Per DP rank, for /health: requests placed there, live ones, and forwards / dummy steps run."""
        return {"data_parallel_placed": list(self.placed), "data_parallel_live": [len(s) for s in self.live],
                "data_parallel_steps": [list(c) for c in self.step_counts()]}

    @property
    def capacity_tokens(self) -> int:
        return self.local.capacity_tokens

    @property
    def held(self) -> dict[str, float]:
        """Held exports of every rank (ids only matter to callers)."""
        remote = {rid: 0.0 for rid, d in self.placement.items()
                  if d and rid in self.exports and rid not in self.live[d]}
        return {**self.local.held, **remote}

    # ---- placement --------------------------------------------------------------------------------
    def pick_rank(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The DP rank for a new request: most cached leading blocks (unless the rank is full), then fewest
        live requests, then fewest placed so far (idle ranks take turns), then lowest rank."""
        root = salted_root(self.local.hash_root, params.cache_salt)
        hashes = block_hashes(prompt_token_ids, self.config.block_size, root)
        best, best_key = 0, None
        for d in range(self.layout.size):
            cached = self.local.cache.pool.hash_to_block if d == 0 else self.remote_hashes[d]
            hits = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
            load = len(self.live[d])
            key = (0 if load >= self.config.max_num_seqs else hits, -load, -self.placed[d], -d)
            if best_key is None or key > best_key:
                best, best_key = d, key
        return best

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: EngineInput | list[int], params: SamplingParams,
                    export_state: bool = False, imported: ExportedState | None = None, group: str | None = None
                    ) -> str:
        request_id = request_id or f"dp-req-{next(self._ids)}"
        if request_id in self.placement:
            from shared.errors import InvalidRequest
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = prompt.prompt_token_ids if isinstance(prompt, EngineInput) else list(prompt)
        d = self.pick_rank(list(ids), params)
        self._on(d, "add_request", (request_id, prompt, params, export_state, imported, group))
        self.placement[request_id] = d
        self.placed[d] += 1
        self.live[d].add(request_id)
        if export_state:
            self.exports.add(request_id)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        d = self.placement.get(request_id)
        if d is None:
            return None
        out = self._on(d, "abort", (request_id,))
        self._forget(d, request_id)
        return out

    def export_state(self, request_id: str) -> ExportedState:
        d = self.placement.get(request_id)
        if d is None:
            raise KeyError(f"no held state for request {request_id!r}")
        return self._on(d, "export_state", (request_id,))

    def release_export(self, request_id: str, reason: str = "released") -> bool:
        d = self.placement.get(request_id)
        if d is None:
            return False
        released = self._on(d, "release_export", (request_id, reason))
        self._forget(d, request_id)
        return released

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Rank 0's expired leases here; the other ranks expire theirs in their steps."""
        expired = self.local.expire_leases(now)
        for rid in expired:
            self._forget(0, rid)
        return expired

    def _forget(self, d: int, request_id: str) -> None:
        self.live[d].discard(request_id)
        self.placement.pop(request_id, None)
        self.exports.discard(request_id)

    def _on(self, d: int, method: str, args: tuple) -> Any:
        """Run an engine method on DP rank d (here for rank 0); its exception is raised here."""
        if d == 0:
            return getattr(self.local, method)(*args)
        self.channel.broadcast(("call", d, method, args))
        answers = self.channel.gather(None)
        assert answers is not None
        return _unwrap(answers[d])

    # ---- stepping ---------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.local.has_unfinished() or any(self.live[d] for d in range(1, self.layout.size))

    def step(self) -> list[RequestOutput]:
        """One lock-step forward of every DP rank; every rank's outputs."""
        self.channel.broadcast(("step",))
        outputs = step_once(self.local)
        answers = self.channel.gather(None)
        assert answers is not None
        for d in range(1, self.layout.size):
            outs, load = _unwrap(answers[d])
            self.loads[d] = load
            apply_events(self.remote_hashes[d], load["events"])
            self.events.extend(load["events"])
            outputs += outs
        for out in outputs:
            if out.finished:
                d = self.placement.get(out.request_id, 0)
                self.live[d].discard(out.request_id)
                if out.request_id not in self.exports:
                    self.placement.pop(out.request_id, None)
        return outputs

    def close(self) -> None:
        """Stop every DP rank's leader, then this host's ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.broadcast(("stop",))
        finally:
            self.local.close()


def _unwrap(answer: tuple[str, Any]) -> Any:
    status, value = answer
    if status == "err":
        raise value
    return value


class _SchedulerView:
    """Counts over every DP rank, for health and load reports (`AsyncEngine.stats`)."""

    def __init__(self, front: DataParallelEngine) -> None:
        self.front = front

    def _total(self, key: str) -> int:
        f = self.front
        return len(getattr(f.local.scheduler, key)) + sum(r[key] for r in f.loads[1:])

    @property
    def running(self) -> range:
        return range(self._total("running"))

    @property
    def waiting(self) -> range:
        return range(self._total("waiting"))

    @property
    def num_preemptions(self) -> int:
        f = self.front
        return f.local.scheduler.num_preemptions + sum(r["preemptions"] for r in f.loads[1:])


class _CacheView:
    """The worker's cache as the store sees it: every DP rank's blocks and KV events."""

    def __init__(self, front: DataParallelEngine) -> None:
        self.front = front

    @property
    def usage(self) -> float:
        f = self.front
        return (f.local.cache.usage + sum(r["usage"] for r in f.loads[1:])) / f.layout.size

    def drain_events(self) -> list:
        f = self.front
        events = f.local.cache.drain_events() + list(f.events)
        f.events.clear()
        return events

    @property
    def pool(self) -> Any:
        f = self.front
        hashes = dict.fromkeys(f.local.cache.pool.hash_to_block)
        for remote in f.remote_hashes[1:]:
            hashes.update(dict.fromkeys(remote))
        return _Pool(hashes)


class _Pool:
    def __init__(self, hash_to_block: dict) -> None:
        self.hash_to_block = hash_to_block


def apply_events(hashes: set[int], events: list) -> None:
    """A remote rank's cached block hashes, kept from its KV events."""
    for event in events:
        if isinstance(event, BlockStored):
            hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            hashes.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            hashes.clear()
