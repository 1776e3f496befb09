"""`kimi-pd up --autoscale`: the pools of a local fleet follow the planner's signal.

Each decision reads the store once (`Signal.refresh`), then per pool starts workers up to the
desired count, or retires the newest worker when there are more than desired: SIGTERM, so it
deregisters and reports `draining` at once (routers send it nothing new) and exits once the
requests it serves are done. A retiring worker no longer counts toward its pool and is never
restarted. The damping lives in the signal (`kimi_pd.planner.signal.Damper`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kimi_pd.planner.signal import POOLS


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
