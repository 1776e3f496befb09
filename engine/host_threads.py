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

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

OPENMP_DEFAULTS: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
OPT_OUT = "KIMI_PD_OPENMP_DEFAULTS"
# any of these set by the operator means they chose how idle OpenMP threads wait: leave them be
WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to `env` (empty when opted out or when the operator set a wait knob)."""
    if env.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
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
    return {k: env.get(k) for k in ("OMP_NUM_THREADS", *WAIT_KNOBS, OPT_OUT)}
