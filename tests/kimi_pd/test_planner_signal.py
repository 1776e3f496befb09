"""The autoscaler's signal: loads per pool from store records, target tracking, bounds and damping
(a load step up and down followed within a stated time, no flapping), and the exported metrics."""
from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time

import httpx
import pytest

from kimi_pd.planner.exporter import Signal, parse_bounds
from kimi_pd.planner.signal import (
    DESIRED_METRIC,
    Bounds,
    Damper,
    PoolLoad,
    Targets,
    pool_loads,
    raw_desired,
    render_metrics,
)
from shared.net import free_port
from shared.store.base import WorkerRecord
from shared.store.embedded import EmbeddedValkey
from shared.store.memory import InMemoryStore
from shared.store.redis_store import RedisStore
from shared.workers import LoadReport, WorkerInfo


def record(wid: str, role: str, running: int = 0, waiting: int = 0, held: int = 0, draining: bool = False):
    info = WorkerInfo(wid, role, f"http://127.0.0.1:{8100 + len(wid)}", "kimi-k3")
    return WorkerRecord(info, LoadReport(running=running, waiting=waiting, held=held, draining=draining), 0.0)


def test_pool_loads_count_serving_workers_and_their_work():
    loads = pool_loads([record("p0", "prefill", 1, 2, held=3), record("p1", "prefill", draining=True),
                        record("d0", "decode", 5, 1, held=9), record("w0", "worker", 2)])
    assert loads == {"prefill": PoolLoad(1, 6), "decode": PoolLoad(2, 8)}


@pytest.mark.parametrize(("pool", "busy", "want"), [
    ("prefill", 0, 0), ("prefill", 1, 1), ("prefill", 4, 2), ("prefill", 5, 3),
    ("decode", 0, 0), ("decode", 6, 1), ("decode", 7, 2), ("decode", 60, 10),
])
def test_raw_desired_is_target_tracking(pool, busy, want):
    assert raw_desired(pool, PoolLoad(1, busy), Targets(prefill_busy_per_worker=2, decode_fill=0.75,
                                                         decode_batch=8)) == want


@pytest.mark.parametrize(("bounds", "n", "want"), [(Bounds(1, 4), 0, 1), (Bounds(1, 4), 9, 4), (Bounds(0, 4), 0, 0),
                                                   (Bounds(2, 2), 1, 2)])
def test_bounds_clamp(bounds, n, want):
    assert bounds.clamp(n) == want


def test_bounds_parse_and_reject():
    assert parse_bounds("2:8") == Bounds(2, 8)
    for bad in ("8", "5:2", "-1:3"):
        with pytest.raises(ValueError):
            parse_bounds(bad)


def test_damper_follows_a_load_step_up_at_once_and_down_slowly_without_flapping():
    """Every 5 s a reading: idle, then a step to 8 workers' worth for 60 s, then idle again with a
    one-reading blip. Up: there within two readings (max 4 a decision). Down: not before the 60 s
    window has passed, then one worker per 30 s, never up again on the blip (the window's peak)."""
    damper = Damper(Bounds(1, 10), down_window_s=60, down_step_s=30, max_step_up=4)
    raw = [1] * 4 + [8] * 12 + [1] * 4 + [2] + [1] * 60
    out = [damper.decide(5.0 * i, n) for i, n in enumerate(raw)]
    assert out[:4] == [1] * 4
    assert out[4:6] == [5, 8], "follows a rise within two readings"
    step_down = out.index(7, 16)
    assert 5.0 * step_down >= 5.0 * 15 + 60, "no scale-in before the window passed since the last high reading"
    assert out[-1] == 1, "back at the floor in the end"
    changes = [b - a for a, b in zip(out, out[1:], strict=False) if b != a]
    assert all(c > 0 for c in changes[:2]) and all(c == -1 for c in changes[2:]), f"flapped: {out}"
    downs = [i for i in range(1, len(out)) if out[i] < out[i - 1]]
    assert all((b - a) * 5.0 >= 30 for a, b in zip(downs, downs[1:], strict=False)), "one worker per 30 s"
    assert 5.0 * (downs[-1] - 15) <= 60 + 7 * 30 + 5, "follows a fall within the window + one step per worker"


def test_metrics_text_and_the_exporter_reading_a_store():
    store = InMemoryStore()

    async def scenario() -> dict[str, int]:
        for wid, role in (("p0", "prefill"), ("d0", "decode")):
            await store.register(record(wid, role).info, ttl_s=30)
        await store.heartbeat("p0", LoadReport(running=1, waiting=6), ttl_s=30)
        await store.heartbeat("d0", LoadReport(running=8), ttl_s=30)
        signal = Signal(store, {"prefill": Bounds(1, 3), "decode": Bounds(1, 8)}, Targets(), 60, 30)
        return await signal.refresh(0.0), signal.text

    desired, text = asyncio.run(scenario())
    assert desired == {"prefill": 3, "decode": 2}                  # 7 busy / 2 -> 4, bounded to 3; 8 / 6 -> 2
    assert re.search(rf'^{DESIRED_METRIC}{{pool="prefill"}} 3$', text, re.M)
    assert re.search(rf'^{DESIRED_METRIC}{{pool="decode"}} 2$', text, re.M)
    assert 'kimi_pd_planner_busy{pool="prefill"} 7' in text
    assert render_metrics({"prefill": 0, "decode": 1}, {"prefill": PoolLoad(0, 0), "decode": PoolLoad(1, 0)}).count(
        "# TYPE") == 3


def test_the_autoscale_signal_command_serves_the_desired_counts(tmp_path):
    """`kimi-pd autoscale-signal` against a real store: a loaded decode pool shows as desired workers
    on GET /metrics within a few readings (what the HPAs of deploy/k8s read)."""
    with EmbeddedValkey() as valkey:
        async def register() -> None:
            store = RedisStore(valkey.url)
            await store.register(record("d0", "decode").info, ttl_s=60)
            await store.heartbeat("d0", LoadReport(running=8, waiting=10), ttl_s=60)
            await store.close()

        asyncio.run(register())
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", "autoscale-signal", "--redis-url", valkey.url,
                                 "--port", str(port), "--interval-s", "0.2", "--decode-bounds", "1:5"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            deadline, text = time.monotonic() + 30, ""
            while time.monotonic() < deadline and f'{DESIRED_METRIC}{{pool="decode"}} 3' not in text:
                with contextlib.suppress(httpx.HTTPError):
                    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                time.sleep(0.2)
            assert f'{DESIRED_METRIC}{{pool="decode"}} 3' in text, text     # 18 busy / 6 a worker
            assert f'{DESIRED_METRIC}{{pool="prefill"}} 1' in text          # idle: the lower bound
            assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=2).status_code == 404
        finally:
            proc.terminate()
            proc.wait(10)
