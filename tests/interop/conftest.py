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
