"""Start an engine's follower ranks, join the group, shard; and stop them again.

Rank 0 is the engine's own process; the other ranks of its host are child processes (`follower.py`)
started with the same interpreter and environment, meeting at `master_addr:master_port` (127.0.0.1
and a free port on one host). With `nnodes` > 1 the ranks split evenly over the hosts: node 0 serves
and holds rank 0, every other node runs `run_headless` (its share of ranks, no server), all pointed
at node 0's address. `TensorParallel.close()` stops the local followers (a `stop` command, then
terminate/kill after a grace period); it also runs at garbage collection and interpreter exit, and
each follower exits by itself when its parent dies or rank 0's connection breaks.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from engine.checkpoint.loader import load_checkpoint
from engine.dtypes import torch_dtype
from engine.model.kda import KDAOptions
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration, ModelOptions
from engine.parallel.comm import TPGroup, rank_device
from engine.parallel.config import ParallelConfig
from engine.parallel.runner import TPModelRunner
from engine.parallel.shard import shard_model
from engine.spec_decode.parallel import check_before_ranks
from shared.model_config import ModelConfig
from shared.net import free_port

log = logging.getLogger(__name__)


def parallel_config(config) -> ParallelConfig:
    return ParallelConfig(config.tensor_parallel_size, config.enable_expert_parallel)


def build_rank(config, rank: int, port: int) -> tuple[TPGroup, KimiK3ForConditionalGeneration]:
    """Join the group as `rank`, load the checkpoint on this rank's device, keep its shard, fuse it."""
    parallel = parallel_config(config)
    device = rank_device(config.device, rank)
    group = TPGroup.join(rank, parallel.tensor_parallel_size, port, device, master_addr=config.master_addr)
    options = ModelOptions(kda=KDAOptions(chunk_size=config.kda_chunk_size))
    model = load_checkpoint(config.model, torch_dtype(config.dtype), device, options)
    shard_model(model, parallel, group)
    model.fuse_linears()                # per shard: the fused weights are this rank's rows
    return group, model


def _stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def node_ranks(config, node: int) -> range:
    """The ranks host `node` runs: an even share, in order (node 0 holds rank 0)."""
    tp, nnodes = config.tensor_parallel_size, config.nnodes
    if nnodes < 1 or tp % nnodes or not 0 <= node < nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tensor-parallel-size {tp}, and 0 <= --node-rank < nnodes")
    if nnodes > 1 and not config.master_port:
        raise ValueError("ranks on several hosts meet at --master-addr:--master-port: give --master-port")
    per = tp // nnodes
    return range(node * per, (node + 1) * per)


def spawn_followers(config, ranks: range | list[int], port: int) -> list[subprocess.Popen]:
    payload = json.dumps(dataclasses.asdict(config))
    threads = max(1, torch.get_num_threads() // max(1, len(node_ranks(config, config.node_rank))))
    return [subprocess.Popen([sys.executable, "-m", "engine.parallel.follower", "--rank", str(r), "--port", str(port),
                              "--config", payload, "--threads", str(threads)]) for r in ranks]


def run_headless(config) -> int:
    """A node without rank 0 (`--headless`): run this node's ranks until they exit; their worst exit code."""
    ranks = node_ranks(config, config.node_rank)
    if 0 in ranks:
        raise ValueError("node 0 holds rank 0 and serves: start it without --headless")
    procs = spawn_followers(config, ranks, config.master_port)
    log.info("headless node %d: ranks %s, rendezvous %s:%d", config.node_rank, list(ranks), config.master_addr,
             config.master_port)
    try:
        codes = [p.wait() for p in procs]
    finally:
        _stop_processes(procs, 0.0)
    return max(codes, default=0)


class TensorParallel:
    """Rank 0's handle on the engine's ranks."""

    def __init__(self, config) -> None:
        self.parallel = parallel_config(config)
        check_before_ranks(config)                     # DSpark runs sharded over these ranks; a bad draft stops here
        self.parallel.check(ModelConfig.from_file(Path(config.model) / "config.json").text_config)
        local = node_ranks(config, 0)
        if config.node_rank != 0:
            raise ValueError("only node 0 serves (it holds rank 0); run the others with --headless")
        port = config.master_port or free_port()
        self.procs = spawn_followers(config, local[1:], port)
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, 0.0)
        self.runner: TPModelRunner | None = None
        try:
            self.group, self.model = build_rank(config, 0, port)
        except BaseException:
            self._finalizer()
            raise
        log.info("tensor parallel: %d ranks%s", self.parallel.tensor_parallel_size,
                 ", expert parallel" if self.parallel.enable_expert_parallel else "")

    def alive(self) -> bool:
        """False once a follower of this host has exited (remote ranks show up as a failed collective)."""
        return all(p.poll() is None for p in self.procs)

    def make_runner(self, cache_config, identity, proposer=None) -> TPModelRunner:
        """proposer: DSpark's `TPProposer`; the other ranks build their share of the draft from its command."""
        self.group.broadcast((cache_config, identity))
        self.runner = TPModelRunner(self.model, cache_config, identity, self.group, proposer)
        if proposer is not None:
            self.group.broadcast(proposer.setup_command())
        return self.runner

    def close(self, timeout: float = 10.0) -> None:
        """Stop every follower (idempotent)."""
        if not self._finalizer.alive:
            return
        try:
            if self.runner is not None and all(p.poll() is None for p in self.procs):
                self.runner.stop()
        finally:
            self.group.close()
            self._finalizer.detach()
            _stop_processes(self.procs, timeout)
