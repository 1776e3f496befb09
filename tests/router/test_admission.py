"""router/admission: tenants files, rate limits (store and store-down fallback), the admission queue."""
from __future__ import annotations

import asyncio
import os

import pytest

from router.admission.limits import RateLimiter, Throttled, duration
from router.admission.queue import AdmissionQueue
from router.admission.tenants import PRIORITY_SPAN, Tenant, TenantConfigError, Tenants, parse_tenants
from router.metrics import RouterMetrics
from shared.store import InMemoryStore, StoreUnavailable

GOOD = """
[tenants.default]
rpm = 100
[tenants.acme]
keys = ["sk-acme-0001", "sk-acme-0002"]
rpm = 3
tpm = 1000
priority = 1
queue_timeout_s = 2.5
"""


def test_tenants_file_parses_and_resolves_keys(tmp_path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    tenants = Tenants(str(path), client_keys=("sk-plain-client",))
    assert tenants.resolve("sk-acme-0002").name == "acme"
    assert tenants.resolve("sk-plain-client").name == "default"     # $KIMI_PD_API_KEYS: the default tenant
    assert tenants.resolve("sk-wrong-key!") is None and tenants.resolve("") is None
    acme = tenants.by_name["acme"]
    assert (acme.rpm, acme.tpm, acme.priority, acme.queue_timeout_s) == (3, 1000, 1, 2.5)
    assert "sk-acme" not in repr(acme)                                # keys never in a repr (logs)
    assert Tenants(None).resolve("anything").name == "default"        # keyless: everyone is the default tenant


@pytest.mark.parametrize(("text", "message"), [
    ("[tenants.a]\nrpm = 0", "rpm must be a positive integer"),
    ("[tenants.a]\ntpm = -5", "tpm must be a positive integer"),
    ("[tenants.a]\nrpm = 1.5", "rpm must be a positive integer"),
    ("[tenants.a]\nburst = 3", "unknown setting(s) burst"),
    ("[tenants.a]\nkeys = ['short']", "at least 8 characters"),
    ("[tenants.a]\nkeys = ['same-key-1']\n[tenants.b]\nkeys = ['same-key-1']", "listed twice"),
    ("[tenants.'a b']\nrpm = 1", "names are 1-64"),
    ("[tenants.a]\npriority = 5000", "priority must be an integer"),
    ("[tenants.a]\nqueue_timeout_s = 0", "queue_timeout_s must be a positive"),
    ("rpm = 5", "expected one table"),
    ("[tenants.a\nrpm = 1", "not valid TOML"),
])
def test_bad_configs_are_refused_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(TenantConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_tenants(text, ".toml")


def test_start_up_refuses_a_bad_file_and_a_reload_keeps_the_old_tenants(tmp_path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": {"a": {"rpm": "many"}}}')
    with pytest.raises(TenantConfigError, match=r"tenants\.json: tenant 'a': rpm"):
        Tenants(str(path))
    path.write_text('{"tenants": {"a": {"rpm": 5, "keys": ["key-aaaa-1"]}}}')
    now = [0.0]
    tenants = Tenants(str(path), clock=lambda: now[0])
    path.write_text('{"tenants": {"a": {"rpm": 0}}}')                 # refused: the old file stays in force
    os.utime(path, (1e9, 1e9))
    now[0] = 2.0
    assert tenants.resolve("key-aaaa-1").rpm == 5
    path.write_text('{"tenants": {"b": {"rpm": 7, "keys": ["key-bbbb-1"]}}}')
    os.utime(path, (2e9, 2e9))
    now[0] = 4.0
    assert tenants.resolve("key-bbbb-1").rpm == 7 and tenants.resolve("key-aaaa-1") is None


def test_open_to_all_follows_the_keys_a_reload_brings(tmp_path) -> None:
    """The router skips the Authorization header only while no key is configured: a reload that adds
    keys closes it again, one that removes them opens it."""
    assert Tenants(None).open_to_all() and not Tenants(None, client_keys=("sk-plain-client",)).open_to_all()
    path, now = tmp_path / "tenants.json", [0.0]
    path.write_text('{"tenants": {"a": {"rpm": 5}}}')                  # limits, no keys: still open
    tenants = Tenants(str(path), clock=lambda: now[0])
    assert tenants.open_to_all()
    path.write_text('{"tenants": {"a": {"rpm": 5, "keys": ["key-aaaa-1"]}}}')
    os.utime(path, (1e9, 1e9))
    now[0] = 2.0
    assert not tenants.open_to_all() and tenants.resolve("key-aaaa-1").name == "a"
    path.write_text('{"tenants": {"a": {"rpm": 5}}}')
    os.utime(path, (2e9, 2e9))
    now[0] = 4.0
    assert tenants.open_to_all()


def test_metric_labels_are_bounded(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("".join(f"[tenants.t{i:03d}]\nrpm = 1\n" for i in range(100)))
    tenants = Tenants(str(path))
    labels = {tenants.label(t) for t in tenants.by_name.values()}
    assert len(labels) == 65 and "other" in labels


def test_effective_priority_orders_by_class_then_request() -> None:
    gold, bronze = Tenant("gold", priority=-1), Tenant("bronze", priority=1)
    assert Tenant("x").effective_priority(7) == 7                     # no class: the client's own value
    assert gold.effective_priority(10**9) < Tenant("x").effective_priority(-(10**9)) < bronze.effective_priority(-5)
    assert bronze.effective_priority(-5) < bronze.effective_priority(3) < 2 * PRIORITY_SPAN


def test_duration_format() -> None:
    assert [duration(s) for s in (0.02, 1.5, 59.0, 360.0)] == ["20ms", "1.5s", "59s", "6m0s"]


@pytest.mark.asyncio
async def test_requests_per_minute_and_429_headers() -> None:
    limiter = RateLimiter(InMemoryStore(), "r1")
    acme = Tenant("acme", rpm=2, tpm=1000)
    grant = await limiter.admit(acme, 10, 20)
    assert grant.headers["x-ratelimit-remaining-requests"] == "1"
    assert grant.headers["x-ratelimit-remaining-tokens"] == "970"
    await limiter.admit(acme, 10, 20)
    with pytest.raises(Throttled) as info:
        await limiter.admit(acme, 10, 20)
    exc = info.value
    assert exc.status == 429 and exc.type == "requests" and exc.code == "rate_limit_exceeded"
    assert exc.headers["retry-after"] == "30" and exc.headers["x-ratelimit-limit-requests"] == "2"
    body = exc.response().model_dump()["error"]
    assert body["type"] == "requests" and "acme" in body["message"]


@pytest.mark.asyncio
async def test_completion_tokens_are_reserved_then_settled() -> None:
    limiter = RateLimiter(InMemoryStore(), "r1")
    t = Tenant("t", tpm=100)
    grant = await limiter.admit(t, 10, 60)                 # 70 reserved
    with pytest.raises(Throttled) as info:
        await limiter.admit(t, 10, 30)                     # 40 > 30 left
    assert info.value.type == "tokens"
    await limiter.settle(grant, 5)                         # used 15: 55 come back
    assert (await limiter.admit(t, 10, 30)).headers["x-ratelimit-remaining-tokens"] in ("44", "45")
    with pytest.raises(Throttled, match="Request too large"):
        await limiter.admit(t, 90, 20)                     # more than a minute's worth: never fits


class FlakyStore(InMemoryStore):
    down = False

    async def take_buckets(self, specs, force=False):
        if self.down:
            raise StoreUnavailable("down")
        return await super().take_buckets(specs, force)

    async def router_heartbeat(self, router_id, ttl_s):
        if self.down:
            raise StoreUnavailable("down")
        return await super().router_heartbeat(router_id, ttl_s)


@pytest.mark.asyncio
async def test_store_down_falls_back_to_a_local_share_and_says_so() -> None:
    store, metrics = FlakyStore(), RouterMetrics()
    a, b = RateLimiter(store, "a", metrics), RateLimiter(store, "b")
    await a.heartbeat()
    await b.heartbeat()
    await a.heartbeat()
    assert a.replicas == 2 and a.mode == "store"
    t = Tenant("t", rpm=10)
    store.down = True
    admitted = 0
    for _ in range(10):
        try:
            await a.admit(t, 1, 1)
            admitted += 1
        except Throttled:
            pass
    assert admitted == 5 and a.mode == "local"                     # 1/N of the limit on this replica
    assert metrics.ratelimit_local._value.get() == 1
    store.down = False
    await a.heartbeat()
    assert a.mode == "store" and metrics.ratelimit_local._value.get() == 0


@pytest.mark.asyncio
async def test_queue_serves_a_high_priority_request_behind_fifty_low_ones_first() -> None:
    queue = AdmissionQueue(lambda: 1, max_queued=100, timeout_s=10)
    await queue.acquire((0, 0))                            # the one slot is busy
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        await queue.acquire((0, priority))
        order.append(name)
        await asyncio.sleep(0)
        queue.release()
    tasks = [asyncio.create_task(one(f"low{i}", 10)) for i in range(50)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("high", 0)))
    await asyncio.sleep(0)
    queue.release()
    await asyncio.gather(*tasks)
    assert order[0] == "high" and order[1:] == [f"low{i}" for i in range(50)]
    assert queue.inflight == 0


@pytest.mark.asyncio
async def test_queue_deadline_full_queue_and_cancel() -> None:
    metrics = RouterMetrics()
    queue = AdmissionQueue(lambda: 1, max_queued=1, timeout_s=0.2, metrics=metrics)
    await queue.acquire((0, 0))
    with pytest.raises(Throttled) as info:
        await queue.acquire((0, 0))                        # nothing frees within 0.2 s
    assert info.value.status == 503 and info.value.code == "queue_timeout" and "retry-after" in info.value.headers
    waiter = asyncio.create_task(queue.acquire((0, 0), timeout_s=5))
    await asyncio.sleep(0.01)
    with pytest.raises(Throttled) as full:
        await queue.acquire((0, 0))
    assert full.value.code == "queue_full"
    waiter.cancel()                                        # the client left: its place goes at once
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queue.waiting == 0
    queue.release()
    assert queue.inflight == 0                             # the cancelled waiter took no slot
    assert await queue.acquire((0, 0)) == 0.0
