"""The fault suite: fleets of real processes whose workers, routers and stores are killed, stopped or scaled
away (`kimi-pd up` under SIGKILL, pools that grow and shrink, the chaos run's 2-minute CI form), and routers
under hostile clients and workers at fleet size (200 slowloris connections, poisoned ids against four
workers, the keep-alive race, the fuzz run; the default suite has their lighter in-process forms). Its tests
start whole fleets, so the suite is not part of the default run, which must stay under ten minutes on two
cores: it runs with `-m faults` or `KIMI_PD_FAULTS=1` (`.ci/run` does, after the default suite)."""
from __future__ import annotations

from pathlib import Path

from tests.opt_in import OptInSuite

SUITE = OptInSuite("fault suite", "faults", "KIMI_PD_FAULTS", "fleets under killed processes and injected faults",
                   Path(__file__).resolve().parent)

pytest_configure = SUITE.register                    # the marker's help line
pytest_collection_modifyitems = SUITE.mark           # marked, and skipped unless asked for


