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


@pytest.mark.parametrize(("argv", "workers"), [([], "1"), (["--router-workers", "3"], "3")])
def test_up_runs_one_router_process_unless_asked(monkeypatch, argv: list[str], workers: str) -> None:
    """On one host the engine workers need the cores: `up` gives the router --workers 1 by default."""
    import kimi_pd.up
    seen: dict = {}
    monkeypatch.setattr(kimi_pd.up, "up", lambda *a: seen.setdefault("router_args", a[-1]) and 0)
    assert main(["up", "--port", "1", *argv]) == 0
    args = seen["router_args"]
    assert args[args.index("--workers") + 1] == workers


def test_router_processes_default_to_the_cores_this_process_may_use(monkeypatch) -> None:
    import os

    from router.cli import WORKERS_ENV, router_processes, usable_cores
    assert 1 <= router_processes(None) == usable_cores() <= len(os.sched_getaffinity(0))
    assert router_processes(1) == 1
    monkeypatch.setenv(WORKERS_ENV, "3")                 # the environment's default (tests/conftest.py sets 1)
    assert build_parser().parse_args(["router"]).workers == 3
    monkeypatch.delenv(WORKERS_ENV)
    assert build_parser().parse_args(["router"]).workers is None
    with pytest.raises(ValueError, match="--workers 0"):
        router_processes(0)
