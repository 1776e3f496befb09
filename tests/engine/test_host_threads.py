"""The engine's OpenMP defaults: applied before torch loads, never over an operator's choice."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host_threads import OPENMP_DEFAULTS, apply_openmp_defaults, openmp_defaults, openmp_settings

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
