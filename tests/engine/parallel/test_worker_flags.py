"""The vLLM-named worker flags reach the engine's config."""
from __future__ import annotations

import argparse

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
