"""The interop suite: kimi-pd's router in front of stock vLLM (CPU build) P/D instances.

Not part of the default run (it installs vLLM into a cached venv and starts several vLLM servers):
it runs with `-m interop` or `KIMI_PD_INTEROP=1` (`.ci/run` does, after the default suite).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.opt_in import OptInSuite

SUITE = OptInSuite("interop suite", "interop", "KIMI_PD_INTEROP", "against a real vLLM",
                   Path(__file__).resolve().parent)

pytest_configure = SUITE.register                    # the marker's help line
pytest_collection_modifyitems = SUITE.mark           # marked, and skipped unless asked for


@pytest.fixture(scope="session")
def vllm_python():
    from tests.interop.vllm_fleet import vllm_python
    return vllm_python()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python, tmp_path_factory):
    from tests.interop.vllm_fleet import cache_dir, tiny_llama
    return tiny_llama(vllm_python, cache_dir() / "tiny-llama-v2")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a fleet shows what its processes were doing: each one's log tail and the
    host's busiest processes (an interop failure on a 2-core CI host is often a starved process, and the
    logs are gone with the fleet's temporary directory)."""
    outcome = yield
    report = outcome.get_result()
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if report.failed and report.when == "call" and fleet is not None:
        from tests.interop.vllm_fleet import fleet_report
        report.sections.append(("fleet at the failure", fleet_report(fleet)))
