"""`make_store`: pick the state store implementation from a URL."""
from __future__ import annotations

from typing import Any

from shared.store.base import StateStore
from shared.store.memory import InMemoryStore
from shared.store.redis_store import RedisStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# the store URL when no --redis-url is given: it may hold a password, which the environment keeps out of `ps`
REDIS_URL_ENV = "KIMI_PD_REDIS_URL"


def make_store(url: str | None, namespace: str = "default", **options: Any) -> StateStore:
    """None or "memory://" -> InMemoryStore (process-local; `namespace` is moot), a Redis URL ->
    RedisStore(url, namespace, **options). Raises ValueError for any other scheme."""
    if url is None or url == "memory://":
        return InMemoryStore()
    if url.startswith(REDIS_SCHEMES):
        return RedisStore(url, namespace=namespace, **options)
    raise ValueError(f"unsupported state store URL scheme: {url.split('://', 1)[0]!r} "
                     f"(use memory://, redis://, rediss:// or unix://)")
