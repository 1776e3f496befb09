"""A worker that closes a connection without answering (issue 11: the keep-alive race - a pooled
connection the worker closes just as the router reuses it) costs no request: a leg the worker never
answered, and that is safe to replay (no transfer parameters), is retried on another worker."""
from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.e2e.fleet import Fleet, metric

pytestmark = pytest.mark.timeout(120)
HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}"


class Closer:
    """Answers GET /health (other GETs 404); reads a POST and closes the connection without a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.dropped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                if data.startswith(b"GET /health"):
                    conn.sendall(HEALTH)
                    continue
                if data.startswith(b"GET "):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.dropped += 1
                return                                      # close: no status line, nothing


def test_unanswered_decode_only_legs_are_retried_elsewhere(tmp_path, e2e_model):
    closer = Closer()
    with Fleet(tmp_path, e2e_model) as f:
        good = f.stub("decode", "good")
        f.wait(good)
        r = f.router("r", "--decode", good.url, "--decode", closer.url)
        f.wait(r, "/ready")
        body = {"model": "kimi-k3", "max_tokens": 2}
        for i in range(12):
            # prompts that share no block (a chat template's shared head would pin them to one worker):
            # the two idle workers tie and the rendezvous hash of each request id picks one, so the
            # closer is tried with probability 1 - 2**-12 (placement is otherwise deterministic)
            resp = httpx.post(r.url + "/v1/completions", timeout=30,
                              json={**body, "prompt": f"{i} " * 40 + "question"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kimi-pd-decode-worker"] == good.url
        assert closer.dropped >= 1                          # the closer was tried and its legs were replayed
        assert metric(r.url, "kimi_pd_router_retries_total", leg="decode") == closer.dropped
    closer.sock.close()
