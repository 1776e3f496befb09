from __future__ import annotations

from pathlib import Path

import pytest

from kimi_pd.bench.tokenizer import TokenPool, load_tokenizer


@pytest.fixture(scope="session")
def bench_model(tiny_dir) -> Path:
    return tiny_dir


@pytest.fixture(scope="session")
def pool(bench_model) -> TokenPool:
    return TokenPool.of(load_tokenizer(bench_model))
