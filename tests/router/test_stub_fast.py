"""The fast stub server (tests/stub_fast.py) answers as the FastAPI stub does: same status, headers
that matter, bodies and streams (ids and timestamps aside), same leg counters."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.net import free_port
from tests.stub_worker import StubSettings, create_app

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx.*starlette.testclient")
    from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "say five words please"}]
CASES: list[tuple[str, str, Any]] = [
    ("POST", CHAT, {"model": "kimi-k3", "messages": MSG}),
    ("POST", CHAT, {"model": "kimi-k3", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"model": "kimi-k3", "prompt": "a b c", "max_tokens": 3}),
    ("POST", CHAT, {"model": "kimi-k3", "messages": MSG, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}),
    ("POST", CHAT, {"model": "kimi-k3", "messages": MSG, "kv_transfer_params": {"do_remote_prefill": True}}),
    ("POST", CHAT, {"model": "other", "messages": MSG}),
    ("POST", CHAT, "not json"),
    ("GET", "/v1/models", None),
    ("GET", "/stats", None),
]
_VOLATILE = re.compile(r'("(?:id|created|remote_request_id|remote_engine_id|remote_port|worker_id)":)("[^"]*"|\d+)')


def _normal(text: str) -> str:
    return _VOLATILE.sub(r"\1X", text)


def _send(client: Any, method: str, path: str, body: Any) -> tuple[int, str, str]:
    if body is None:
        r = client.request(method, path)
    else:
        r = client.request(method, path, content=body if isinstance(body, str) else json.dumps(body),
                           headers={"content-type": "application/json"})
    return r.status_code, r.headers.get("content-type", "").split(";")[0], _normal(r.text)


@pytest.fixture
def fast_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.stub_worker", "--port", str(port), "--role", "both",
                             "--tokens", "5", "--fast"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fast_stub_answers_as_the_fastapi_stub(fast_url):
    slow = TestClient(create_app(StubSettings(role="both", tokens=5, port=0)))
    with httpx.Client(base_url=fast_url, timeout=10) as fast:
        for method, path, body in CASES:
            assert _send(fast, method, path, body) == _send(slow, method, path, body), (method, path, body)
