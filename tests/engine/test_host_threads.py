"""The engine's OpenMP defaults: applied before torch loads, never over an operator's choice."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host_threads import (
    OPENMP_DEFAULTS,
    ForwardThreads,
    ForwardThreadSetter,
    apply_openmp_defaults,
    openmp_defaults,
    openmp_settings,
    process_threads,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "added"), [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"OMP_NUM_THREADS": "1"}, {"OMP_WAIT_POLICY": "PASSIVE"}),       # the thread count is not a wait knob
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {}),                               # the operator's policy wins
    ({"GOMP_SPINCOUNT": "10000"}, {}),                                 # so does their spin count
    ({"KIMI_PD_OPENMP_DEFAULTS": "0"}, {}),                            # opted out
    ({"KIMI_PD_OPENMP_DEFAULTS": "off"}, {}),
    ({"KIMI_PD_OPENMP_DEFAULTS": "1"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_defaults_table(env, added):
    assert openmp_defaults(env) == added


def test_apply_sets_the_environment_it_is_given():
    env: dict[str, str] = {"OMP_NUM_THREADS": "2"}
    assert apply_openmp_defaults(env, torch_loaded=False) == dict(OPENMP_DEFAULTS)
    assert env == {"OMP_NUM_THREADS": "2", **OPENMP_DEFAULTS}
    assert openmp_settings(env)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_too_late_after_torch_says_so_and_changes_nothing(caplog):
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="engine.host_threads"):
        assert apply_openmp_defaults(env, torch_loaded=True) == {}
    assert env == {}
    assert "torch was imported before engine" in caplog.text


def _env_after_import(code: str, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                           "KIMI_PD_OPENMP_DEFAULTS")}
    env.update(extra, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_import_engine_sets_the_default_before_torch_loads():
    code = "import sys, os, engine; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    assert _env_after_import(code) == "PASSIVE False"
    assert _env_after_import(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE False"
    assert _env_after_import(code, KIMI_PD_OPENMP_DEFAULTS="0") == "None False"


# ---- one intra-op thread for small forwards -------------------------------------------------------

@pytest.mark.parametrize(("env", "hidden", "cores", "below"), [
    ({}, 1024, 2, 32),                                               # a small host: on by default
    ({}, 128, 4, 2048),                                              # narrower layers: more tokens
    ({}, 7168, 2, 1),                                                # K3's width: every forward on all
    ({}, 1024, 8, 0),                                                # a larger host was not measured: off
    ({"KIMI_PD_ONE_THREAD_BELOW_TOKENS": "0"}, 1024, 2, 0),          # the operator turns it off
    ({"KIMI_PD_ONE_THREAD_BELOW_TOKENS": "16"}, 1024, 32, 16),       # or sets it, anywhere
])
def test_forward_threads_from_env(env, hidden, cores, below):
    assert ForwardThreads.from_env(hidden, env, max_threads=2, usable_cores=cores).one_thread_below == below


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5"])
def test_forward_threads_rejects_a_bad_setting(raw):
    with pytest.raises(ValueError, match="KIMI_PD_ONE_THREAD_BELOW_TOKENS"):
        ForwardThreads.from_env(1024, {"KIMI_PD_ONE_THREAD_BELOW_TOKENS": raw}, max_threads=2, usable_cores=2)


def test_threads_for_a_forward():
    policy = ForwardThreads(max_threads=4, one_thread_below=64)
    assert [policy.threads_for(n) for n in (1, 8, 63, 64, 512)] == [1, 1, 1, 4, 4]
    assert ForwardThreads(max_threads=4, one_thread_below=0).threads_for(1) == 4


def test_the_setter_calls_torch_only_when_the_count_changes(monkeypatch):
    import torch
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    setter = ForwardThreadSetter(ForwardThreads(max_threads=2, one_thread_below=64))
    for tokens in (1, 1, 8, 300, 300, 1, 64):
        setter.before_forward(tokens)
    assert calls == [1, 2, 1, 2]


def test_the_engine_runs_small_forwards_on_one_thread_and_prefill_on_all(tiny_dir):
    """A decode step leaves torch on one thread; a forward of 64+ prompt tokens on all of them."""
    import torch

    from engine.core.engine import EngineConfig, LLMEngine
    from shared.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=2, cache_memory_bytes=32 << 20))
    runner = engine.runner
    assert runner.forward_threads is not None
    setter = runner.forward_threads
    setter.policy = ForwardThreads(max_threads=2, one_thread_below=64)
    seen: list[int] = []
    real_forward = runner.model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_forward(*args, **kwargs)

    runner.model.forward = spy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request("long", list(range(1, 100)), params)
        while engine.has_unfinished():
            engine.step()
    finally:
        runner.model.forward = real_forward
        torch.set_num_threads(setter.policy.max_threads)
        engine.close()
    assert seen[0] == 2 and seen[-1] == 1 and len(seen) >= 3


def test_an_engine_made_after_another_decoded_still_gets_every_thread():
    """The policy's thread count is the process's, not whatever the last forward left torch at."""
    import torch
    process_threads()                                  # read before any setter acts (an engine's first runner)
    start = torch.get_num_threads()
    try:
        ForwardThreadSetter(ForwardThreads.from_env(1024, {}, usable_cores=2)).before_forward(1)
        assert torch.get_num_threads() == 1
        assert ForwardThreads.from_env(1024, {}, usable_cores=2).max_threads == process_threads()
    finally:
        torch.set_num_threads(start)
