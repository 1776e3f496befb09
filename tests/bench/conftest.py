from __future__ import annotations

from pathlib import Path

import pytest

from kimi_pd.bench.tokenizer import TokenPool, load_tokenizer


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("bench-model") / "tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def pool(bench_model) -> TokenPool:
    return TokenPool.of(load_tokenizer(bench_model))
