"""router.transport.front: the router's own HTTP protocol for the two OpenAI POST routes, served by uvicorn as
`kimi-pd router` serves it, in front of stub workers on loopback. Same answers as the ASGI path,
the body bound before parsing, OpenAI errors, keep-alive, chunked streams, a leaving client cancels,
header and body deadlines, poisoned request ids. (The fleet-sized forms of the last two, 200 slowloris
connections and a P/D fleet of four workers, are in the fault suite: tests/faults/.)"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from router.app import create_app
from router.settings import RouterSettings
from router.transport.front import front_protocol_class
from tests.e2e.fleet import raw_post
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app

MAX_BYTES = 4096
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _serve(app, http="auto") -> tuple[str, uvicorn.Server]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, http=http))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def router():
    servers = []
    try:
        decode_url, d = _serve(stub_app(StubSettings(role="both", tokens=4, token_delay_s=0.05)))
        servers.append(d)
        settings = RouterSettings(model=None, static_both=(decode_url,), max_request_bytes=MAX_BYTES,
                                  api_keys=("client-key",), admin_token="admin-token")
        app = create_app(settings)
        url, r = _serve(app, http=front_protocol_class(5.0, app, MAX_BYTES))
        servers.append(r)
        yield url
    finally:
        for server in servers:
            server.should_exit = True


AUTH = {"authorization": "Bearer client-key"}


def test_chat_answer_headers_and_keep_alive(router):
    with httpx.Client(base_url=router, headers=AUTH, timeout=20) as client:
        for _ in range(3):                                     # one keep-alive connection
            reply = client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
            assert reply.headers["x-kimi-pd-decision"] == "decode-only"
            assert reply.headers["x-request-id"].startswith("chat-")
            assert reply.headers["content-length"] == str(len(reply.content))
        completion = client.post("/v1/completions", json={"model": "kimi-k3", "prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
        assert client.get("/health").json() == {"status": "ok"}          # other routes: the ASGI app
        assert client.get("/v1/models").json()["data"][0]["id"] == "kimi-k3"


def test_stream_is_chunked_sse_ending_in_done(router):
    with httpx.Client(base_url=router, headers=AUTH, timeout=20) as client, \
            client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as reply:
        assert reply.status_code == 200
        assert reply.headers["transfer-encoding"] == "chunked"
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = "".join(reply.iter_text())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_gets_413_before_it_is_read_and_the_connection_stays_usable(router, chunked):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BYTES * 4)}]}).encode()
    with httpx.Client(base_url=router, headers=AUTH, timeout=20) as client:
        content = (big[i:i + 1000] for i in range(0, len(big), 1000)) if chunked else big
        reply = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_openai_errors_from_the_hot_routes(router):
    with httpx.Client(base_url=router, timeout=20) as client:
        unauthorized = client.post("/v1/chat/completions", json=CHAT)
        assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
        bad_json = client.post("/v1/chat/completions", content=b"{not json", headers=AUTH)
        assert bad_json.status_code == 400 and "error" in bad_json.json()
        wrong_model = client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=AUTH)
        assert wrong_model.status_code == 404 and wrong_model.json()["error"]["type"]


def _cancelled(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("kimi_pd_router_requests_total") and 'outcome="cancelled"' in line)


def test_a_client_leaving_mid_stream_cancels_the_relay(router):
    admin = {"authorization": "Bearer admin-token"}
    before = _cancelled(httpx.get(f"{router}/metrics", headers=admin).text)
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 40}).encode()
    port = int(router.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer client-key\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")   # the stream started (40 tokens x 50 ms)
    deadline = time.monotonic() + 10
    while _cancelled(httpx.get(f"{router}/metrics", headers=admin).text) <= before:
        assert time.monotonic() < deadline, "the relay did not notice the client leaving"
        time.sleep(0.1)


@contextlib.contextmanager
def router_with_deadlines(header_timeout_s: float, **front: float) -> Iterator[str]:
    """A router of its own in front of a quick stub, its front protocol given these deadlines; its URL."""
    decode_url, d = _serve(stub_app(StubSettings(role="both", tokens=2)))
    app = create_app(RouterSettings(model=None, static_both=(decode_url,), max_request_bytes=MAX_BYTES))
    url, r = _serve(app, http=front_protocol_class(header_timeout_s, app, MAX_BYTES, **front))
    try:
        yield url
    finally:
        r.should_exit = d.should_exit = True


def test_a_body_that_never_finishes_is_cut_at_its_deadline():
    """Headers in time, then a trickle: the connection is closed once the body deadline passes, so slow-body
    clients cannot hold connections and buffers; whole requests on the same server still get answers."""
    with router_with_deadlines(5.0, body_timeout_s=0.5) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 200\r\n\r\n{\"model\":")
            started = time.monotonic()
            assert slow.recv(1024) == b""                                  # closed by the server, no answer
            assert 0.4 < time.monotonic() - started < 5
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=20).status_code == 200


def test_headers_that_never_finish_are_cut_at_the_header_deadline():
    """A slowloris client (one more header byte now and then, never the blank line) is closed once the header
    deadline passes; whole requests on the same server are answered meanwhile."""
    with router_with_deadlines(0.5) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            started = time.monotonic()
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            # answered while the trickle is open: a slow connection blocks nobody
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=5).status_code == 200
            closed = False
            while not closed and time.monotonic() - started < 5:
                try:
                    slow.sendall(b"x")
                    slow.settimeout(0.1)
                    closed = slow.recv(1024) == b""
                except TimeoutError:
                    pass
                except OSError:                        # reset by the server
                    closed = True
            assert closed and 0.4 < time.monotonic() - started < 5
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=20).status_code == 200


@pytest.mark.parametrize("bad", ["abc\u0000def", "a b", "x" * 129, "line\r\nx-evil: 1", "", "quote\"id"])
def test_a_poisoned_request_id_is_the_clients_400_not_a_worker_failure(router, bad):
    """Client ids never reach a worker's headers: a bad one is refused before placement, so no circuit opens."""
    admin = {"authorization": "Bearer admin-token"}
    with httpx.Client(base_url=router, timeout=20) as client:
        for _ in range(6):                                     # more than the breaker's 5 consecutive failures
            refused = client.post("/v1/chat/completions", content=json.dumps({**CHAT, "request_id": bad}),
                                  headers={**AUTH, "content-type": "application/json"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id", refused.text
        assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        (worker,) = client.get("/admin/workers", headers=admin).json()["workers"]
    assert worker["circuit"] == "closed" and worker["inflight"] == 0


def test_client_request_ids_never_reach_a_worker_and_bad_headers_are_never_a_5xx(router):
    """The router names every request itself: a client's id (body or header) is not in the answer's id, and
    a poisoned x-request-id header (NUL, raw UTF-8, 300 bytes) is answered or refused, never a 5xx."""
    for header in (b"x-request-id: a\x00b", b"x-request-id: \xc3\xa9t\xc3\xa9", b"x-request-id: " + b"y" * 300):
        status = raw_post(router, "/v1/chat/completions", json.dumps(CHAT).encode(),
                          b"authorization: Bearer client-key\r\n" + header)
        assert status.split()[1] in (b"200", b"400"), (header, status)
    resp = httpx.post(router + "/v1/chat/completions", json={**CHAT, "request_id": "client-id-42"},
                      headers={**AUTH, "x-request-id": "hdr-7"}, timeout=20)
    assert resp.status_code == 200
    assert "client-id-42" not in resp.headers["x-request-id"] and "hdr-7" not in resp.headers["x-request-id"]
    (worker,) = httpx.get(router + "/admin/workers", headers={"authorization": "Bearer admin-token"},
                          timeout=5).json()["workers"]
    assert worker["circuit"] == "closed"
