"""Fixtures shared by every test package."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.opt_in import OptInSuite

# routers the tests start are one process unless a test asks for more (`--workers`): the default, one per
# core, would change what the fleet tests measure and cost them start-up time (docs/router-processes.md)
os.environ.setdefault("KIMI_PD_ROUTER_WORKERS", "1")

# the parallel suite: engines whose ranks are separate processes (TP, DP x EP, speculation and P/D across
# them, a rank's death) checked against TP=1, about four minutes on two cores; its files live beside the
# default tests they extend, so it is named here. The default suite keeps the flag parsing and layout tests.
_TESTS = Path(__file__).resolve().parent
PARALLEL = OptInSuite("parallel suite", "parallel", "KIMI_PD_PARALLEL", "multi-process TP/DP/EP engines against TP=1",
                      _TESTS / "engine" / "parallel",
                      files=(_TESTS / "engine" / "spec_decode" / "test_tp_spec.py",
                             _TESTS / "e2e" / "test_pd_data_parallel.py",
                             _TESTS / "e2e" / "test_pd_tensor_parallel.py"))
_FLAG_TESTS = ("test_dp_flags.py", "test_worker_flags.py")     # argument parsing only: stay in the default run


def pytest_configure(config: pytest.Config) -> None:
    PARALLEL.register(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    PARALLEL.mark(config, [item for item in items if Path(item.path).name not in _FLAG_TESTS])


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis/Valkey URL for the whole session: $REDIS_URL if set, else one embedded Valkey server
    (stopped at the end). Tests share the server, so each must use its own key namespace."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from shared.store.embedded import EmbeddedValkey
    with EmbeddedValkey() as server:
        yield server.url


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The generated `tiny` checkpoint (seed 0), made once a session: tests only read it (one that
    changes a checkpoint makes its own)."""
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_w4a8_dir(tmp_path_factory) -> Path:
    """`tiny_dir`'s W4A8 twin (the same seed), made once a session."""
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("tiny-model") / "tiny-w4a8", seed=0, quant="w4a8",
                             progress=False)


@pytest.fixture(scope="session")
def e2e_model(tiny_dir) -> Path:
    """The model the fleets of real processes serve (tests/e2e, tests/faults): `tiny_dir`."""
    return tiny_dir
