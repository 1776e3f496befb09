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
from engine.parallel.dp_comm import DPChannel, join_dp
from engine.parallel.dp_config import DPLayout
from engine.parallel.dp_rank import DPRank
from engine.parallel.runner import TPModelRunner
from engine.parallel.shard import shard_model
from engine.spec_decode.parallel import check_before_ranks
from shared.model_config import ModelConfig
from shared.net import free_port

log = logging.getLogger(__name__)


def parallel_config(config) -> ParallelConfig:
    return ParallelConfig(config.tensor_parallel_size, config.enable_expert_parallel, config.data_parallel_size)


def _load_shard(config, device: str, group: TPGroup, expert_parallel=None) -> KimiK3ForConditionalGeneration:
    options = ModelOptions(kda=KDAOptions(chunk_size=config.kda_chunk_size))
    model = load_checkpoint(config.model, torch_dtype(config.dtype), device, options)
    shard_model(model, parallel_config(config), group, expert_parallel)
    model.fuse_linears()                # per shard: the fused weights are this rank's rows
    return model


def build_rank(config, rank: int, port: int) -> tuple[TPGroup, KimiK3ForConditionalGeneration]:
    """Join the group as `rank`, load the checkpoint on this rank's device, keep its shard, fuse it."""
    if config.data_parallel_size > 1:
        group, model, _ = build_dp_rank(config, rank)
        return group, model
    device = rank_device(config.device, rank)
    group = TPGroup.join(rank, config.tensor_parallel_size, port, device, master_addr=config.master_addr)
    return group, _load_shard(config, device, group)


def build_dp_rank(config, rank: int) -> tuple[TPGroup, KimiK3ForConditionalGeneration, DPChannel | None]:
    """Global `rank` of a data-parallel engine: join every group, load and keep its shards."""
    layout = DPLayout.of(config)
    device = rank_device(config.device, rank - layout.local_ranks()[0])
    group, expert_parallel, channel = join_dp(layout, rank, device)
    return group, _load_shard(config, device, group, expert_parallel), channel


def config_payload(config) -> str:
    """The EngineConfig as JSON for a rank process; a parsed `--speculative-config` goes as vLLM's fields
    (asdict would add its `extra` dict, which the rank's parser refuses as an unknown field)."""
    d = dataclasses.asdict(config)
    spec = getattr(config, "speculative_config", None)
    if spec is not None and hasattr(spec, "to_dict"):
        d["speculative_config"] = spec.to_dict()
    return json.dumps(d)


def spawn_dp_ranks(config, threads: int) -> list[subprocess.Popen]:
    """This host's ranks of a data-parallel engine except global rank 0 (the front's own process):
    DP leaders run `dp_leader`, the others `follower`, all meeting at the DP address and RPC port."""
    layout = DPLayout.of(config)
    payload = config_payload(config)
    procs = []
    for g in layout.local_ranks():
        if g == 0:
            continue
        module = ["engine.parallel.dp_leader"] if g % layout.tensor_parallel_size == 0 else \
            ["engine.parallel.follower", "--port", str(layout.rpc_port)]
        procs.append(subprocess.Popen([sys.executable, "-m", *module, "--rank", str(g), "--config", payload,
                                       "--threads", str(threads)]))
    return procs


def start_data_parallel(config) -> tuple[DPRank, DPChannel]:
    """Node 0: start this host's other ranks, join as global rank 0; (DP rank 0's handle, the command channel)."""
    layout = DPLayout.of(config)
    if layout.start_rank != 0:
        raise ValueError("only the node with --data-parallel-start-rank 0 serves; start the others with --headless")
    parallel_config(config).check(ModelConfig.from_file(Path(config.model) / "config.json").text_config)
    check_before_ranks(config)                         # each DP rank drafts on its own ranks; a bad draft stops here
    if not layout.rpc_port:
        config = dataclasses.replace(config, data_parallel_rpc_port=free_port())
    threads = max(1, torch.get_num_threads() // len(layout.local_ranks()))
    procs = spawn_dp_ranks(config, threads)
    try:
        group, model, channel = build_dp_rank(config, 0)
    except BaseException:
        _stop_processes(procs, 0.0)
        raise
    assert channel is not None
    log.info("data parallel: %d ranks x TP %d%s, %d on this host", layout.size, layout.tensor_parallel_size,
             ", expert parallel" if config.enable_expert_parallel else "", layout.size_local)
    return DPRank(group, model, channel, procs, _stop_processes), channel


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
    payload = config_payload(config)
    threads = max(1, torch.get_num_threads() // max(1, len(node_ranks(config, config.node_rank))))
    return [subprocess.Popen([sys.executable, "-m", "engine.parallel.follower", "--rank", str(r), "--port", str(port),
                              "--config", payload, "--threads", str(threads)]) for r in ranks]


def run_headless(config) -> int:
    """A node without rank 0 (`--headless`): run this node's ranks until they exit; their worst exit code."""
    if config.data_parallel_size > 1:
        layout = DPLayout.of(config)
        if layout.start_rank == 0:
            raise ValueError("DP rank 0 serves: give a headless node --data-parallel-start-rank > 0")
        procs = spawn_dp_ranks(config, max(1, torch.get_num_threads() // len(layout.local_ranks())))
        log.info("headless node: DP ranks %d..%d, rendezvous %s:%d", layout.start_rank,
                 layout.start_rank + layout.size_local - 1, layout.address, layout.rpc_port)
    else:
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


def tensor_parallel(config) -> TensorParallel | None:
    """An engine's own ranks: None at TP=1; a data-parallel engine gets its handle from its launcher."""
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 runs several engines: build it with dp_engine.create_engine")
    return TensorParallel(config) if config.tensor_parallel_size > 1 else None


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
