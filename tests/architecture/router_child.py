"""Run in a fresh interpreter by test_router_torch_free: the `kimi-pd` parser, then a router over two stub
workers (P and D, in this process, on free loopback ports) serves one P/D chat request and one decode-only
completion, then reports which heavy modules got imported."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

import uvicorn
from fastapi.testclient import TestClient

from router.app import create_app
from router.settings import RouterSettings
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app


def serve_stub(role: str) -> tuple[str, uvicorn.Server]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stub_app(StubSettings(role=role, tokens=4, port=port)),
                                           log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError(f"stub {role} did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


def main(model_dir: str) -> None:
    from kimi_pd.cli import build_parser  # what `kimi-pd router` runs before the app
    build_parser().parse_args(["router", "--model", model_dir, "--worker", "http://127.0.0.1:1"])
    (p_url, p), (d_url, d) = serve_stub("prefill"), serve_stub("decode")
    settings = RouterSettings(model=model_dir, static_prefill=(p_url,), static_decode=(d_url,),
                              disagg_threshold_tokens=1)
    report = {}
    try:
        with TestClient(create_app(settings)) as client:
            chat = client.post("/v1/chat/completions", json={
                "model": "kimi-k3", "max_tokens": 4,
                "messages": [{"role": "user", "content": "a prompt long enough to be worth a prefill leg"}]})
            report["chat"] = [chat.status_code, chat.headers.get("x-kimi-pd-decision"),
                              chat.json()["choices"][0]["message"]["content"]]
            stream = client.post("/v1/completions", json={"model": "kimi-k3", "prompt": "hi", "max_tokens": 4,
                                                          "stream": True})
            report["stream"] = [stream.status_code, stream.text.rstrip().endswith("data: [DONE]")]
    finally:
        p.should_exit = d.should_exit = True
    heavy = {"torch", "engine", "kv_transfer", "prefill_worker", "decode_worker"}
    parser_only = ("worker.flags", "worker.dp_flags")           # the worker flags: the parser only, torch-free
    report["heavy"] = sorted(m for m in sys.modules if m.split(".")[0] in heavy
                             or (m.startswith("worker.") and m not in parser_only))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
