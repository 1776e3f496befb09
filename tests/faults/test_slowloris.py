"""Slowloris (issue 11): 200 connections that trickle request headers, one byte a round, neither stop
normal requests nor stay open: the header deadline (--header-timeout, 3 s here) closes every one of them
within a few seconds of it, while requests keep being served. The run ends once all are closed (at most
DURATION_S)."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2e.fleet import Fleet

pytestmark = pytest.mark.timeout(120)
SLOW, DURATION_S, HEADER_TIMEOUT_S = 200, 10.0, 3.0


def test_slow_header_connections_are_closed_and_do_not_block(tmp_path, e2e_model):
    with Fleet(tmp_path, e2e_model) as f:
        d = f.stub("decode", "d")
        f.wait(d)
        r = f.router("r", "--decode", d.url, "--header-timeout", str(HEADER_TIMEOUT_S))
        f.wait(r, "/ready")
        port = int(r.url.rsplit(":", 1)[1])
        slow = []
        for _ in range(SLOW):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            slow.append(sock)
        closed_at: dict[int, float] = {}
        start, served = time.monotonic(), 0
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - start < DURATION_S and len(closed_at) < SLOW:
                for i, sock in enumerate(slow):              # one more header byte every round, forever
                    if i in closed_at:
                        continue
                    try:
                        sock.sendall(b"x")
                        sock.setblocking(False)
                        if sock.recv(1) == b"":
                            closed_at[i] = time.monotonic() - start
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed_at[i] = time.monotonic() - start
                    finally:
                        sock.setblocking(True)
                resp = client.post(r.url + "/v1/chat/completions", json=body)   # normal traffic keeps flowing
                assert resp.status_code == 200, resp.text
                served += 1
                time.sleep(0.2)
        for sock in slow:
            sock.close()
        assert served >= 5                                   # served while the slow ones were open
        assert len(closed_at) == SLOW, f"{SLOW - len(closed_at)} slow connections still open after {DURATION_S} s"
        assert max(closed_at.values()) < HEADER_TIMEOUT_S + 5, sorted(closed_at.values())[-5:]
