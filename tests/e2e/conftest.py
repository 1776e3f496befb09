from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint.create import create_checkpoint


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    return create_checkpoint("tiny", tmp_path_factory.mktemp("e2e-model") / "tiny", seed=0, progress=False)
