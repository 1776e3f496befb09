"""One data-parallel rank: its ranks' handle, its runner (with the dummy step), and a leader's loop.

A DP leader (`dp_leader.py`) answers the front's commands (`dp_comm.DPChannel`): ("step",) runs one
engine step, or the dummy step when its scheduler has nothing to run, and reports its outputs and
load; ("call", d, method, args) runs an engine method on rank d; ("stop",) ends the loop.
"""
from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from engine.core.model_runner import ModelRunner
from engine.parallel.comm import TPGroup
from engine.parallel.dp_comm import DPChannel, dummy_step, portable
from engine.parallel.runner import TPModelRunner

log = logging.getLogger(__name__)


class DPRunner(ModelRunner):
    """A DP rank's runner without tensor parallelism: counts forwards, runs the dummy step.

    With DSpark a step is still one target forward: prefill chunks and verify blocks share it, and the
    draft (dense layers, the target's embedding and LM head) exchanges nothing across DP ranks."""

    forwards = 0
    dummies = 0

    def run_model(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        self.forwards += 1
        return super().run_model(input_ids, batch)

    def dummy(self) -> None:
        self.dummies += 1
        dummy_step(self.model)


class DPTPRunner(TPModelRunner):
    """A DP rank's tensor-parallel leader runner: its followers replay the dummy step too."""

    forwards = 0
    dummies = 0

    def run_model(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        self.forwards += 1
        return super().run_model(input_ids, batch)

    def dummy(self) -> None:
        self.dummies += 1
        self.group.broadcast(("dummy",))
        dummy_step(self.model)


class DPRank:
    """What `LLMEngine(parallel=...)` needs of one DP rank's ranks: the model shard, the runner, liveness."""

    def __init__(self, group: TPGroup, model, channel: DPChannel | None, procs: list[subprocess.Popen] | None = None,
                 stop_processes: Callable[[list[subprocess.Popen], float], None] | None = None):
        """procs, stop_processes: the rank processes this host started, and how the launcher stops them."""
        self.group, self.model, self.channel = group, model, channel
        self.procs = procs or []
        self._stop_processes = stop_processes
        self.runner: DPRunner | DPTPRunner | None = None

    def make_runner(self, cache_config, identity, proposer=None) -> DPRunner | DPTPRunner:
        """proposer: this DP rank's DSpark draft (its TP followers build their share from its command)."""
        if self.group.world_size > 1:
            self.group.broadcast((cache_config, identity))
            self.runner = DPTPRunner(self.model, cache_config, identity, self.group, proposer)
            if proposer is not None:
                self.group.broadcast(proposer.setup_command())
        else:
            self.runner = DPRunner(self.model, cache_config, identity,
                                   proposer.capture_layers if proposer else (), proposer)
        return self.runner

    def alive(self) -> bool:
        """False once a rank process this host started has exited (remote ones fail the next collective)."""
        return all(p.poll() is None for p in self.procs)

    def close(self, timeout: float = 10.0) -> None:
        try:
            if isinstance(self.runner, DPTPRunner):
                self.runner.stop()
        finally:
            self.group.close()
            if self._stop_processes is not None:
                self._stop_processes(self.procs, timeout)
            self.procs = []


def step_once(engine) -> list:
    """One engine step; a rank whose scheduler ran no forward runs the dummy step, so the MoE exchanges
    of every DP rank line up (one forward per rank per step)."""
    runner = engine.runner
    before = runner.forwards
    outputs = engine.step()
    if runner.forwards == before:
        runner.dummy()
    return outputs


def report(engine) -> dict[str, Any]:
    """A DP rank's load and cache changes, sent with every step's outputs (spec: its DSpark drafts and
    accepted tokens so far, None without speculation)."""
    s, spec = engine.scheduler, engine.spec_stats
    return {"running": len(s.running), "waiting": len(s.waiting), "held": len(engine.held),
            "usage": engine.cache.usage, "preemptions": s.num_preemptions, "unfinished": engine.has_unfinished(),
            "forwards": engine.runner.forwards, "dummies": engine.runner.dummies,
            "spec": (spec.num_drafts, spec.num_accepted_tokens) if spec else None,
            "events": engine.cache.drain_events()}


def guarded(fn) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - delivered to the front, which raises it
        return ("err", portable(exc))


def serve(engine, channel: DPChannel, dp_rank: int) -> None:
    """A leader's loop: the front's commands until ("stop",)."""
    while True:
        command = channel.broadcast()
        kind = command[0]
        if kind == "stop":
            return
        result: Any = None
        if kind == "step":
            result = guarded(lambda: (step_once(engine), report(engine)))
        elif kind == "call" and command[1] == dp_rank:
            method = getattr(engine, command[2])
            result = guarded(lambda: method(*command[3]))  # noqa: B023 - called before the next command
        channel.gather(result)
