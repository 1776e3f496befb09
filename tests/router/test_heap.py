"""The serving process's GC settings (router/transport/heap.py) apply once the app's start-up is done,
and only in the process that asks: checked in a child, since they are process-wide."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import gc, json
from contextlib import asynccontextmanager
from starlette.applications import Starlette
from starlette.testclient import TestClient
from router.transport.heap import YOUNG_THRESHOLD, settle_after_startup

seen = {}

@asynccontextmanager
async def lifespan(app):
    seen["during_startup"] = [gc.get_threshold()[0], gc.get_freeze_count()]
    yield
    seen["after_startup"] = [gc.get_threshold()[0], gc.get_freeze_count() > 0]

before = gc.get_threshold()[0]
app = Starlette(lifespan=lifespan)
settle_after_startup(app)
with TestClient(app):
    pass
print(json.dumps({"before": before, "young": YOUNG_THRESHOLD, **seen}))
"""


def test_settle_after_startup_freezes_the_startup_heap_and_raises_the_young_threshold():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == 700 and seen["during_startup"] == [700, 0]      # nothing changes before start-up ends
    assert seen["after_startup"] == [seen["young"], True]
