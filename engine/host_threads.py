"""OpenMP defaults for a host the engine shares: set before torch loads, so libgomp reads them.

Why: torch's CPU wheel runs its intra-op pool (and MKL) on GNU OpenMP, whose idle threads spin at every
barrier before sleeping. On a quiet host that saves a futex wake per parallel region; on a busy one a
spinning thread burns the time slice its partner needs, and a decode step waits on a preempted thread
(the small preset's batch-1 step was 8x slower with 2 threads than with 1 on a host with other work,
benchmarks/results/engine_throughput.md). `OMP_WAIT_POLICY=PASSIVE` makes idle threads sleep at once.

An operator's own value always wins: set `OMP_WAIT_POLICY` (or `GOMP_SPINCOUNT`) yourself, or
`KIMI_PD_OPENMP_DEFAULTS=0` to leave the environment exactly as given. `engine/__init__.py` applies this
on the first `import engine`, before anything of the engine imports torch; a process that imported
torch earlier keeps libgomp's own defaults and says so in a warning.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

OPENMP_DEFAULTS: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
OPT_OUT = "KIMI_PD_OPENMP_DEFAULTS"
# any of these set by the operator means they chose how idle OpenMP threads wait: leave them be
WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def switched_off(env: Mapping[str, str], name: str) -> bool:
    """Whether the engine's on-by-default switch `name` is set to 0 / false / no / off in `env`."""
    return env.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def openmp_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to `env` (empty when opted out or when the operator set a wait knob)."""
    if switched_off(env, OPT_OUT):
        return {}
    if any(knob in env for knob in WAIT_KNOBS):
        return {}
    return dict(OPENMP_DEFAULTS)


def apply_openmp_defaults(env: MutableMapping[str, str] | None = None,
                          torch_loaded: bool | None = None) -> dict[str, str]:
    """Adds the defaults to `env` (os.environ); returns what it added. Children inherit them too."""
    env = os.environ if env is None else env
    added = openmp_defaults(env)
    if not added:
        return added
    if torch_loaded if torch_loaded is not None else "torch" in sys.modules:
        log.warning("torch was imported before engine: OpenMP keeps its defaults (%s not applied); "
                    "set them in the environment to apply them", added)
        return {}
    env.update(added)
    return added


def openmp_settings(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """What this process runs with (for logs and benchmark results)."""
    env = os.environ if env is None else env
    return {k: env.get(k) for k in ("OMP_NUM_THREADS", *WAIT_KNOBS, OPT_OUT, SMALL_FORWARD_ENV, "KIMI_PD_CPU_GEMM",
                                 "KIMI_PD_CPU_ROWDOT", "KIMI_PD_CPU_PANELS", "KIMI_PD_CPU_DECODE_OPS")}


# ---- intra-op threads per forward ---------------------------------------------------------------
SMALL_FORWARD_ENV = "KIMI_PD_ONE_THREAD_BELOW_TOKENS"
# Measured on the 2-vCPU development host (benchmarks/results/engine_throughput.md): with sleeping
# OpenMP threads every parallel region pays a wake-up (tens of microseconds, more on a VM whose idle
# vCPU halted), and a decode step runs hundreds of small regions over weights one core already reads
# at most of the host's bandwidth. Where a second thread starts to pay depends on the work per region,
# so the default cut is in tokens x hidden_size^2: the small preset (hidden 1024) decoded batch 1 and 8
# 1.4-1.8x faster on one thread and ran 16-token forwards 1.14x faster on one, 32-256-token ones
# 1.09-1.17x faster on two; tiny-chat (hidden 128) was faster on one thread up to 256 tokens (0.40-0.83x
# the time). A cut of 2^25 puts them at 32 and 2048 tokens. Larger hosts were not measured, so there the
# rule is off unless asked for.
SMALL_FORWARD_WORK = 1 << 25
SMALL_HOST_CORES = 4


@dataclass(frozen=True)
class ForwardThreads:
    """How many intra-op threads a forward of `tokens` tokens runs on: one below `one_thread_below`
    tokens (0: never), all of `max_threads` from there on."""

    max_threads: int
    one_thread_below: int

    @classmethod
    def from_env(cls, hidden_size: int, env: Mapping[str, str] | None = None, max_threads: int | None = None,
                 usable_cores: int | None = None) -> ForwardThreads:
        """`KIMI_PD_ONE_THREAD_BELOW_TOKENS` if set (0 turns it off), else, on hosts of at most 4 usable
        cores, the tokens at which tokens x hidden_size^2 reaches SMALL_FORWARD_WORK (32 for a hidden size
        of 1024), and off on larger hosts. `max_threads` defaults to `process_threads()`."""
        env = os.environ if env is None else env
        cores = usable_cores if usable_cores is not None else len(os.sched_getaffinity(0))
        raw = env.get(SMALL_FORWARD_ENV, "").strip()
        if raw:
            try:
                below = int(raw)
            except ValueError:
                raise ValueError(f"{SMALL_FORWARD_ENV}={raw!r}: expected a token count (0 turns it off)") from None
            if below < 0:
                raise ValueError(f"{SMALL_FORWARD_ENV}={raw!r}: expected a token count >= 0")
        else:
            below = -(-SMALL_FORWARD_WORK // max(1, hidden_size) ** 2) if cores <= SMALL_HOST_CORES else 0
        return cls(max(1, max_threads if max_threads is not None else process_threads()), below)

    def threads_for(self, tokens: int) -> int:
        return 1 if tokens < self.one_thread_below else self.max_threads


@functools.cache
def process_threads() -> int:
    """torch's intra-op thread count as the process started: read once, before any `ForwardThreadSetter`
    changes it, so an engine made after another has decoded still gets every thread."""
    import torch
    return torch.get_num_threads()


class ForwardThreadSetter:
    """Applies `ForwardThreads` before each forward, calling torch only when the count changes (the
    draft model and the sampler after a forward run on the count it left)."""

    def __init__(self, policy: ForwardThreads) -> None:
        self.policy = policy
        self._current: int | None = None

    def before_forward(self, tokens: int) -> None:
        want = self.policy.threads_for(tokens)
        if want != self._current:
            import torch
            torch.set_num_threads(want)
            self._current = want
