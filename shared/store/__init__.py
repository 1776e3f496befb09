"""Shared state for router replicas and workers: registry, load, KV events, KV snapshots.

`StateStore` (base) is the contract; `InMemoryStore` serves one process, `RedisStore` a fleet;
`make_store(url, namespace)` picks one; `EmbeddedValkey` runs a local server. Key layout, TTLs and
sequence-number invariants are documented in `shared.store.base`.
"""
from shared.store.base import (
    StateStore,
    StoreError,
    StoreUnavailable,
    WorkerRecord,
)
from shared.store.embedded import EmbeddedValkey, EmbeddedValkeyError
from shared.store.factory import make_store
from shared.store.memory import InMemoryStore
from shared.store.redis_store import RedisStore

__all__ = [
    "EmbeddedValkey", "EmbeddedValkeyError", "InMemoryStore", "RedisStore", "StateStore",
    "StoreError", "StoreUnavailable", "WorkerRecord", "make_store",
]
