from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint.create import create_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return create_checkpoint("tiny", tmp_path_factory.mktemp("engine") / "tiny", seed=0, progress=False)
