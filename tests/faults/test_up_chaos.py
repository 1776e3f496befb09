"""`kimi-pd up` under chaos, with client keys on (issue 11): 1 prefill + 2 decode workers.

- a worker called directly without credentials gets 401 (internal auth follows the client keys);
- one decode worker is SIGKILLed mid-stream: the stream completes through migration and equals the
  uninterrupted greedy answer token for token; `up` restarts the dead worker (and says so), which
  registers again; the next requests succeed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e.fleet import eventually, free_port, metric

pytestmark = pytest.mark.timeout(300)
CLIENT_KEY, ADMIN = "client-key-0123456789", "up-chaos-admin-token-0123"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def pid_of(out, name: str) -> int | None:
    """The pid `kimi-pd up` last reported for its child `name` ("started/restarted NAME (pid N")."""
    found = re.findall(rf"(?:started|restarted) {re.escape(name)} \(pid (\d+)", out.read_text())
    return int(found[-1]) if found else None


def workers(url: str) -> dict[str, dict]:
    listed = httpx.get(url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()
    return {w["worker_id"]: w for w in listed["workers"]}


@pytest.fixture()
def up(tmp_path, e2e_model):
    model = tmp_path / "model"
    shutil.copytree(e2e_model, model)
    port, out = free_port(), tmp_path / "up.out"
    env = {**os.environ, "KIMI_PD_API_KEYS": CLIENT_KEY, "KIMI_PD_ADMIN_TOKEN": ADMIN}
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", "up", "--model", str(model), "--port", str(port),
                                 "--decode-workers", "2", "--log-dir", str(tmp_path / "logs")], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        eventually(lambda: "kimi-pd is up" in out.read_text() or proc.poll() is not None, 180, "kimi-pd up")
        assert proc.poll() is None, out.read_text()
        proc.url, proc.out = f"http://127.0.0.1:{port}", out
        eventually(lambda: sum(w["healthy"] for w in workers(proc.url).values()) == 3, 60, "3 workers")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_up_with_keys_migrates_a_killed_decode_worker_and_restarts_it(up):
    fleet = workers(up.url)
    for info in fleet.values():                                   # nobody goes around the router
        direct = httpx.post(info["url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_api_key", direct.text
    assert httpx.post(up.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 401

    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Tell a long story, please."}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True}
    lines, victim = [], None
    with httpx.stream("POST", up.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        # a fleet with client keys names no workers to its clients: the operator asks the admin API
        assert "x-kimi-pd-decode-worker" not in resp.headers and resp.headers["x-kimi-pd-decision"]
        serving = [wid for wid, w in workers(up.url).items() if w["role"] == "decode" and w["inflight"] == 1]
        assert len(serving) == 1, workers(up.url)
        victim = serving[0]
        for line in resp.iter_lines():
            lines.append(line)
            if sum(x.startswith("data: {") for x in lines) == 5:
                pid = pid_of(up.out, victim)
                assert pid is not None, (victim, up.out.read_text())
                os.kill(pid, signal.SIGKILL)
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "event: error" not in lines and lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    reference = httpx.post(up.url + "/v1/chat/completions", json={**body, "stream": False}, headers=AUTH,
                           timeout=120).json()["choices"][0]
    assert ids == reference["token_ids"] and len(ids) == 400 and text == reference["message"]["content"]
    assert metric(up.url, "kimi_pd_router_migrations_total", outcome="ok") == 1

    eventually(lambda: f"restarted {victim}" in up.out.read_text(), 30, "up restarts the dead worker")
    assert f"{victim} exited (code -9)" in up.out.read_text()
    eventually(lambda: workers(up.url).get(victim, {}).get("healthy"), 120, "worker back")
    assert pid_of(up.out, victim) != pid
    for i in range(4):
        again = httpx.post(up.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                           json={"messages": [{"role": "user", "content": f"again {i}"}], "max_tokens": 3})
        assert again.status_code == 200, again.text
    assert up.poll() is None
