"""The state store as an attack surface (issue 11): the embedded server wants a password that never
appears in its argv, registrations are validated where they are written and where they are read, and
one record no worker could have written is skipped instead of hiding the whole fleet."""
from __future__ import annotations

import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from shared.store import EmbeddedValkey, RedisStore
from shared.store.embedded import EmbeddedValkeyError
from shared.workers import InvalidWorkerRecord, LoadReport, WorkerInfo

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
GOOD = dict(worker_id="decode-0", role="decode", url="http://127.0.0.1:8201", model_id="kimi-k3", transfer_port=9,
            hash_root=2 ** 64 - 1, block_size=16)


@pytest.mark.parametrize("field,value", [("role", "admin"), ("url", "file:///etc/passwd"), ("url", "http://:0"),
                                         ("url", "http://u:p@127.0.0.1:1"), ("worker_id", "a b\x00"),
                                         ("transfer_port", 70000), ("transfer_port", "9"), ("block_size", 0),
                                         ("block_size", True), ("hash_root", -1), ("model_id", ""), ("url", 5)])
async def test_registration_fields_are_validated(field, value):
    with pytest.raises(InvalidWorkerRecord):
        WorkerInfo.from_dict({**GOOD, field: value})
    assert WorkerInfo.from_dict(GOOD).worker_id == "decode-0"


@pytest.mark.parametrize("load", [{"running": -1}, {"cache_usage": 7.0}, {"waiting": "x"}, {"draining": 1},
                                  {"ts": float("nan")}])
async def test_load_reports_are_validated(load):
    with pytest.raises(InvalidWorkerRecord):
        LoadReport.from_dict(load)


async def test_embedded_store_needs_its_password_and_keeps_it_out_of_argv():
    password = "p" * 24 + uuid.uuid4().hex
    with EmbeddedValkey(password=password) as server:
        assert f":{password}@" in server.url
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
        anonymous = aioredis.from_url(f"redis://127.0.0.1:{server.port}")
        with pytest.raises(Exception, match="(?i)auth"):
            await anonymous.set("x", 1)
        await anonymous.aclose()
        store = RedisStore(server.url, namespace="sec")
        await store.register(WorkerInfo(**GOOD), 5.0)
        assert [r.info.worker_id for r in await store.workers()] == ["decode-0"]
        await store.close()
    with pytest.raises(EmbeddedValkeyError):
        EmbeddedValkey(password="short")


async def test_a_forged_record_is_skipped_and_the_rest_still_listed(redis_url):
    ns = f"forge-{uuid.uuid4().hex[:8]}"
    store = RedisStore(redis_url, namespace=ns)
    await store.register(WorkerInfo(**GOOD), 5.0)
    forged = WorkerInfo(**{**GOOD, "worker_id": "fake"})
    with pytest.raises(InvalidWorkerRecord):
        await store.register(WorkerInfo(**{**GOOD, "worker_id": "fake", "url": "gopher://x"}), 5.0)
    await store.register(forged, 5.0)
    raw = aioredis.from_url(redis_url)
    keys = [k for k in await raw.keys(f"*{ns}*") if b"fake" in k and b"worker" in k]
    assert keys, await raw.keys(f"*{ns}*")
    for key in keys:                                 # someone with store access rewrites the record
        await raw.set(key, msgpack.packb({**forged.to_dict(), "url": "file:///etc/passwd"}))
    await raw.aclose()
    assert [r.info.worker_id for r in await store.workers()] == ["decode-0"]
    await store.close()
