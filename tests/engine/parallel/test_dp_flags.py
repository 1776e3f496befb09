"""vLLM's data-parallel flags reach the engine config with vLLM's meaning, and the layout they describe."""
from __future__ import annotations

import argparse

import pytest

from engine.parallel.dp_config import DPLayout
from worker.cli import settings_from_args
from worker.dp_flags import VLLM_DEFAULT_RPC_PORT
from worker.flags import add_worker_args


def engine_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    return settings_from_args(parser.parse_args(list(argv)), "DIR").engine


def test_node0_and_headless_lines_reach_the_engine_config():
    node0 = engine_config("-tp", "2", "--enable-expert-parallel", "--data-parallel-size", "4",
                          "--data-parallel-size-local", "1", "--data-parallel-address", "10.0.0.5",
                          "--data-parallel-rpc-port", "13389")
    assert (node0.data_parallel_size, node0.data_parallel_size_local, node0.data_parallel_start_rank) == (4, 1, 0)
    assert (node0.data_parallel_address, node0.data_parallel_rpc_port) == ("10.0.0.5", 13389)
    node3 = engine_config("-tp", "2", "--headless", "-dp", "4", "-dpl", "1", "-dpr", "3", "-dpa", "10.0.0.5",
                          "-dpp", "13389")
    layout = DPLayout.of(node3)
    assert layout.local_ranks() == [6, 7] and layout.leaders() == [0, 2, 4, 6]
    assert DPLayout.of(node0).local_ranks() == [0, 1] and layout.world_size == 8


def test_defaults_are_vllms():
    one = engine_config()
    assert (one.data_parallel_size, one.data_parallel_size_local, one.data_parallel_rpc_port) == (1, None, 0)
    assert engine_config("--master-addr", "10.0.0.9", "-dp", "2").data_parallel_address == "10.0.0.9"
    # ranks on several hosts need a port every node knows: vLLM's default when none is given
    assert engine_config("-dp", "2", "-dpl", "1").data_parallel_rpc_port == VLLM_DEFAULT_RPC_PORT
    assert DPLayout.of(engine_config("-dp", "2")).local_ranks() == [0, 1]      # all local by default


@pytest.mark.parametrize("argv,match", [
    (("-dp", "2", "-dpl", "2", "-dpr", "1"), "exceeds --data-parallel-size 2"),
    (("-dp", "2", "--nnodes", "2", "-tp", "2", "--master-port", "1"), "not --nnodes"),
    (("-dp", "0",), "must be >= 1"),
])
def test_impossible_layouts_are_refused_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        DPLayout.of(engine_config(*argv))


def test_a_headless_line_without_a_start_rank_is_refused():
    from engine.parallel.launch import run_headless
    with pytest.raises(ValueError, match="--data-parallel-start-rank > 0"):
        run_headless(engine_config("-dp", "2", "-dpl", "1", "--headless"))


def test_a_remote_ranks_request_errors_reach_the_front_as_themselves():
    """Errors cross from a DP rank to the front pickled; those whose constructor pickling cannot
    replay still arrive as a 400-class InvalidRequest with their message, param and code."""
    import pickle

    from engine.parallel.dp_comm import portable
    from shared.errors import InvalidRequest, InvalidTokenIds, RequestTooLarge
    for exc in (RequestTooLarge(100, 64), InvalidTokenIds([9999], 640, param="prompt")):
        got = pickle.loads(pickle.dumps(portable(exc)))
        assert isinstance(got, InvalidRequest)
        assert (str(got), got.param, got.code) == (str(exc), exc.param, exc.code)
    same = InvalidRequest("bad", param="max_tokens")
    assert portable(same) is same
    assert isinstance(portable(_Unpicklable()), RuntimeError)


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__()
        self.lock = __import__("threading").Lock()
