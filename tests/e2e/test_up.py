"""`kimi-pd up` (the README's first command): starts store + P + D + router, serves, stops everything."""
from __future__ import annotations

import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.e2e.fleet import kimi_pd_up

pytestmark = pytest.mark.timeout(240)


def children_alive(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if "pgrep" not in line]


def test_up_serves_and_stops_everything(tmp_path, e2e_model):
    model = tmp_path / "model-for-up"
    shutil.copytree(e2e_model, model)
    engine_flags = ["--max-num-seqs", "3", "--scheduling-policy", "priority", "--max-model-len", "1024"]
    with kimi_pd_up(["--model", str(model), *engine_flags, "--max-inflight-per-worker", "2"],
                    tmp_path / "logs") as (url, proc):
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                "priority": -2}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        children = children_alive(str(model))
        assert len(children) >= 3          # prefill, decode, router
        # the engine flags reach every worker, the admission flag the router (vLLM-style one-command fleet)
        workers = [c for c in children if " prefill " in c or " decode " in c]
        pairs = [" ".join(engine_flags[i:i + 2]) for i in range(0, len(engine_flags), 2)]
        assert len(workers) == 2 and all(pair in c for c in workers for pair in pairs), children
        assert any(" router " in c and "--max-inflight-per-worker 2" in c for c in children), children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert children_alive(str(model)) == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
