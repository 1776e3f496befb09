"""The interop suite: kimi-pd's router in front of stock vLLM (CPU build) P/D instances.

Not part of the default run (it installs vLLM into a cached venv and starts several vLLM servers):
it runs with `-m interop` or `KIMI_PD_INTEROP=1` (`.ci/run` does, after the default suite).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interop: against a real vLLM (run with -m interop or KIMI_PD_INTEROP=1)")


def _enabled(config: pytest.Config) -> bool:
    return os.environ.get("KIMI_PD_INTEROP") == "1" or "interop" in (config.getoption("-m") or "").replace(
        "not interop", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="interop suite: run with -m interop (or KIMI_PD_INTEROP=1)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.interop)
            if not _enabled(config):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python():
    from tests.interop.vllm_fleet import vllm_python
    return vllm_python()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python, tmp_path_factory):
    from tests.interop.vllm_fleet import cache_dir, tiny_llama
    return tiny_llama(vllm_python, cache_dir() / "tiny-llama-v2")
