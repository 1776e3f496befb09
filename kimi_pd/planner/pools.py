"""`kimi-pd up --autoscale`: the pools of a local fleet follow the planner's signal.

Each decision reads the store once (`Signal.refresh`), then per pool starts workers up to the
desired count, or retires the newest worker when there are more than desired: SIGTERM, so it
deregisters and reports `draining` at once (routers send it nothing new) and exits once the
requests it serves are done. A retiring worker no longer counts toward its pool and is never
restarted. The damping lives in the signal (`kimi_pd.planner.signal.Damper`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kimi_pd.planner.exporter import Signal
from kimi_pd.planner.signal import POOLS, Bounds, Targets


@dataclass
class PoolScaler:
    """Starts and retires named workers; `spawn(role, name)` and `retire(name)` do the processes."""

    spawn: Callable[[str, str], None]
    retire: Callable[[str], None]
    members: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in POOLS})
    next_index: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOLS, 0))
    log: list[str] = field(default_factory=list)

    def start(self, pool: str) -> str:
        name = f"{pool}-{self.next_index[pool]}"
        self.next_index[pool] += 1
        self.spawn(pool, name)
        self.members[pool].append(name)
        return name

    def apply(self, desired: dict[str, int]) -> list[str]:
        """Move every pool toward `desired`: all the starts at once, at most one retirement a pool.
        Returns what it did, e.g. ["+decode-2", "-prefill-1"]."""
        done = []
        for pool in POOLS:
            want, have = desired[pool], self.members[pool]
            while len(have) < want:
                done.append("+" + self.start(pool))
            if len(have) > max(want, 1):                   # a pool is never emptied by scale-in
                name = have.pop()
                self.retire(name)
                done.append("-" + name)
        self.log.extend(done)
        return done


@dataclass(frozen=True)
class AutoscaleSettings:
    """`kimi-pd up --autoscale`: pool bounds, targets and damping (see kimi_pd.planner.signal)."""

    prefill: Bounds = Bounds(1, 4)
    decode: Bounds = Bounds(1, 4)
    targets: Targets = Targets()
    interval_s: float = 2.0
    down_window_s: float = 30.0
    down_step_s: float = 15.0


class LocalAutoscaler:
    """Reads the fleet's store every `interval_s` and applies the damped decision to the pools."""

    def __init__(self, settings: AutoscaleSettings, redis_url: str, scaler: PoolScaler,
                 report: Callable[[str], None]) -> None:
        from shared.store.factory import make_store
        self.settings, self.scaler, self.report = settings, scaler, report
        self.loop = asyncio.new_event_loop()                  # the store's client lives on this one loop
        self.store = make_store(redis_url)
        self.signal = Signal(self.store, {"prefill": settings.prefill, "decode": settings.decode},
                             settings.targets, settings.down_window_s, settings.down_step_s)
        self.next_at = 0.0

    def tick(self, now: float) -> list[str]:
        if now < self.next_at:
            return []
        self.next_at = now + self.settings.interval_s
        try:
            desired = self.loop.run_until_complete(self.signal.refresh(now))
        except Exception as exc:                              # noqa: BLE001 - a store outage: keep the pools
            self.report(f"kimi-pd: autoscale: store unreadable, pools unchanged: {exc}")
            return []
        done = self.scaler.apply(desired)
        if done:
            self.report(f"kimi-pd: autoscale {' '.join(done)} (desired {desired})")
        return done

    def close(self) -> None:
        self.loop.run_until_complete(self.store.close())
        self.loop.close()
