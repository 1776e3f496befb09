"""The vLLM-named worker flags reach the engine's config."""
from __future__ import annotations

import argparse

import pytest

from worker.cli import settings_from_args
from worker.flags import add_worker_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    return parser.parse_args(list(argv))


def test_parallel_and_graph_flags_reach_the_engine_config():
    engine = settings_from_args(parse("--tensor-parallel-size", "2", "--enable-expert-parallel", "--enforce-eager",
                                      "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'), "DIR").engine
    assert (engine.tensor_parallel_size, engine.enable_expert_parallel, engine.enforce_eager) == (2, True, True)
    assert engine.compilation_config == '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
    default = settings_from_args(parse(), "DIR").engine
    assert (default.tensor_parallel_size, default.enable_expert_parallel, default.enforce_eager) == (1, False, False)
    assert settings_from_args(parse("-tp", "4"), "DIR").engine.tensor_parallel_size == 4


def test_multi_host_rank_flags_reach_the_engine_config_and_split_the_ranks():
    from engine.parallel.launch import node_ranks
    engine = settings_from_args(parse("-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
                                      "--master-port", "29500"), "DIR").engine
    assert (engine.master_addr, engine.master_port, engine.nnodes, engine.node_rank) == ("10.0.0.5", 29500, 2, 1)
    assert list(node_ranks(engine, 0)) == [0, 1] and list(node_ranks(engine, 1)) == [2, 3]
    with pytest.raises(ValueError, match="--master-port"):
        node_ranks(settings_from_args(parse("-tp", "2", "--nnodes", "2"), "DIR").engine, 0)
    with pytest.raises(ValueError, match="must divide"):
        node_ranks(settings_from_args(parse("-tp", "3", "--nnodes", "2", "--master-port", "1"), "DIR").engine, 0)
