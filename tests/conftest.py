"""Fixtures shared by every test package."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
