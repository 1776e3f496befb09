"""Token buckets kept in the state store, so every router replica draws on one limit per tenant.

A bucket holds up to `capacity` units and refills at `rate_per_s`. `take` looks at all the buckets of
one request (a tenant's requests-per-minute and tokens-per-minute buckets) and, in one atomic step,
either takes every cost or none: a request that fits one limit but not the other consumes nothing.
`force` takes the costs even when they overdraw (settling a request that used more than it
reserved; a negative cost refunds what it reserved but did not use, never above the capacity).

In Redis/Valkey this is one Lua script (atomic on the server, timed by the server's clock so
replicas with skewed clocks agree); `LocalBuckets` is the same arithmetic in one process, used by
`InMemoryStore` and by routers while the store is unreachable.

Key layout (P = "kimipd:{namespace}"): P:bucket:{name} hash {v: level, t: last refill in ms},
PX = time to refill from empty plus a second, so idle tenants' buckets vanish by themselves;
P:routers zset router id -> expiry (server ms): the live router replicas (`router_heartbeat`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of one request: its key, its size, its refill rate and what this request costs."""

    name: str
    capacity: float
    rate_per_s: float
    cost: float


@dataclass(frozen=True)
class BucketResult:
    allowed: bool
    wait_s: float                    # until every refused cost would fit (0 when allowed)
    levels: tuple[float, ...]        # each bucket's level after this call, in the order given


@runtime_checkable
class BucketStore(Protocol):
    """A store that keeps token buckets and a count of live router replicas."""

    async def take_buckets(self, specs: Sequence[BucketSpec], force: bool = False) -> BucketResult: ...

    async def router_heartbeat(self, router_id: str, ttl_s: float) -> int: ...


# KEYS: the buckets. ARGV: force, then (capacity, rate_per_s, cost) per bucket. Levels are returned as
# strings: Redis turns Lua numbers into integers.
TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local force = ARGV[1] == '1'
local levels, wait = {}, 0
for i = 1, #KEYS do
  local cap, rate, cost = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  local h = redis.call('HMGET', KEYS[i], 'v', 't')
  local v, last = tonumber(h[1]), tonumber(h[2])
  if v == nil or last == nil then v, last = cap, now end
  v = math.min(cap, v + math.max(0, now - last) * rate / 1000)
  levels[i] = v
  if cost > v then wait = math.max(wait, (cost - v) * 1000 / rate) end
end
local ok = force or wait == 0
local out = {ok and 1 or 0, tostring(ok and 0 or wait)}
for i = 1, #KEYS do
  local cap, rate, cost = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  if ok then levels[i] = math.min(cap, levels[i] - cost) end
  redis.call('HSET', KEYS[i], 'v', tostring(levels[i]), 't', now)
  redis.call('PEXPIRE', KEYS[i], math.ceil(cap * 1000 / rate) + 1000)
  out[#out + 1] = tostring(levels[i])
end
return out
"""

# KEYS: the routers zset. ARGV: router id, ttl ms. Returns the live replicas, this one included.
ROUTERS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return redis.call('ZCARD', KEYS[1])
"""


def take_args(specs: Sequence[BucketSpec], force: bool) -> list[str]:
    """ARGV of `TAKE_LUA` (repr keeps every float exact)."""
    args = ["1" if force else "0"]
    for s in specs:
        args += [repr(float(s.capacity)), repr(float(s.rate_per_s)), repr(float(s.cost))]
    return args


def check_specs(specs: Sequence[BucketSpec]) -> None:
    if not specs:
        raise ValueError("take_buckets needs at least one bucket")
    for s in specs:
        if not (s.capacity > 0 and s.rate_per_s > 0):
            raise ValueError(f"bucket {s.name!r}: capacity and rate_per_s must be > 0")


class LocalBuckets:
    """`TAKE_LUA`'s arithmetic in this process (every call runs without awaiting: atomic here)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}      # name -> (level, last refill s)
        self._routers: dict[str, float] = {}

    def take(self, specs: Sequence[BucketSpec], force: bool = False) -> BucketResult:
        check_specs(specs)
        now = self._clock()
        levels, wait = [], 0.0
        for s in specs:
            level, last = self._buckets.get(s.name, (s.capacity, now))
            level = min(s.capacity, level + max(0.0, now - last) * s.rate_per_s)
            levels.append(level)
            if s.cost > level:
                wait = max(wait, (s.cost - level) / s.rate_per_s)
        ok = force or wait == 0
        if ok:
            levels = [min(s.capacity, level - s.cost) for s, level in zip(specs, levels, strict=True)]
        for s, level in zip(specs, levels, strict=True):
            self._buckets[s.name] = (level, now)
        return BucketResult(ok, 0.0 if ok else wait, tuple(levels))

    def router_heartbeat(self, router_id: str, ttl_s: float) -> int:
        now = self._clock()
        self._routers[router_id] = now + ttl_s
        self._routers = {r: exp for r, exp in self._routers.items() if exp > now}
        return len(self._routers)
