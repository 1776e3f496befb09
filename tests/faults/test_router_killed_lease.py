"""A router killed between a request's prefill and its decode worker's pull: the prefill state it left
held is freed within seconds (the router renewed a short lease, `--kv-renewed-lease-s`), not at the full
`--kv-lease-s` (30 s). While the router lives, the same state outlasts the short lease (it is renewed)."""
from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.fleet import Fleet, eventually, metric

pytestmark = pytest.mark.timeout(180)
RENEWED_S = 2.0


def held(url: str) -> float:
    return metric(url, "kimi_pd_kv_held_leases")


def test_router_killed_after_prefill_frees_the_state_in_seconds(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        p = f.worker("prefill", "p0", "--kv-renewed-lease-s", str(RENEWED_S))      # --kv-lease-s stays 30
        d = f.stub("decode", "d0", "--first-token-delay-ms", "120000")              # answers late, never pulls
        for proc in (p, d):
            f.wait(proc)
        r = f.router("r0", "--prefill", p.url, "--decode", d.url, "--disagg-threshold", "0")
        f.wait(r, "/ready")
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Ping?"}], "max_tokens": 4}
        client = threading.Thread(target=lambda: _post_ignoring_errors(r.url, body), daemon=True)
        client.start()
        eventually(lambda: held(p.url) == 1, what="the prefill state held")
        time.sleep(3 * RENEWED_S)
        assert held(p.url) == 1                   # the live router renews it past the short lease
        r.kill(signal.SIGKILL)
        killed = time.monotonic()
        eventually(lambda: held(p.url) == 0, timeout_s=25, what="the state freed after the router's death")
        freed_after = time.monotonic() - killed
        assert freed_after < RENEWED_S + 3, freed_after          # well before the 30 s lease
        assert metric(p.url, "kimi_pd_worker_held") == 0


def _post_ignoring_errors(url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):    # the router is killed under it
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
