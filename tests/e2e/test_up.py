"""`kimi-pd up` (the README's first command): starts store + P + D + router, serves, stops everything."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.fleet import free_port

pytestmark = pytest.mark.timeout(240)


def children_alive(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if "pgrep" not in line]


def test_up_serves_and_stops_everything(tmp_path, e2e_model):
    model = tmp_path / "model-for-up"
    shutil.copytree(e2e_model, model)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", "up", "--model", str(model), "--port", str(port),
                             "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("curl"):
                break
        assert any("kimi-pd is up" in line for line in lines), "".join(lines)
        url = f"http://127.0.0.1:{port}"
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert len(children_alive(str(model))) >= 3          # prefill, decode, router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert children_alive(str(model)) == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
