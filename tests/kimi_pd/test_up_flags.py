"""`kimi-pd up` takes the workers' engine flags and the router's admission flags and passes them on."""
from __future__ import annotations

import argparse

import pytest

from kimi_pd.cli import build_parser, main
from kimi_pd.up import ENGINE_FLAGS, ROUTER_FLAGS, passed_argv
from router.cli import add_router_args
from worker.flags import add_worker_args

GIVEN = ["--max-num-seqs", "16", "--max-model-len", "2048", "--scheduling-policy", "priority",
         "--no-enable-prefix-caching", "--cache-memory", "1GiB", "--enforce-eager", "--max-num-batched-tokens", "512"]


def child(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_engine_flags_reach_the_workers_as_if_given_to_them() -> None:
    args = build_parser().parse_args(["up", *GIVEN])
    passed = passed_argv(args, ENGINE_FLAGS)
    assert vars(child(add_worker_args, passed)) == vars(child(add_worker_args, GIVEN))
    assert passed_argv(build_parser().parse_args(["up"]), ENGINE_FLAGS) == []      # nothing given: workers' defaults


def test_admission_flags_reach_the_router(tmp_path) -> None:
    given = ["--max-inflight-per-worker", "4", "--max-queued", "64", "--queue-timeout", "7.5"]
    passed = passed_argv(build_parser().parse_args(["up", *given]), ROUTER_FLAGS)
    assert vars(child(add_router_args, passed)) == vars(child(add_router_args, given))


def test_bad_values_are_refused_before_anything_starts(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--scheduling-policy", "lifo"])
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.a]\nrpm = -1\n")
    assert main(["up", "--tenants", str(bad), "--port", "1"]) == 2
    assert "rpm must be a positive integer" in capsys.readouterr().err
