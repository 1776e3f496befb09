"""http(s) image URLs against a local HTTP server on loopback: the fetched image renders exactly as the
same image sent as a data: URL (and the request then carries it inlined), within vLLM's limits (size,
timeout, allowed domains); loopback, private and link-local hosts are refused unless the operator
allows them (SSRF), redirects included; a corrupt image is a clean 400."""
from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from engine.presets import tiny_config
from shared.errors import InvalidRequest
from shared.model_config import VisionConfig
from shared.openai.prompts import prepare_chat
from shared.openai.requests import ChatCompletionRequest
from shared.openai.surface import SurfaceOptions
from shared.prompt.media_fetch import MediaFetchError, MediaFetchLimits, checked_address, fetch_url_bytes
from shared.prompt.tokenizer import KimiTokenizer

LOCAL = MediaFetchLimits(allow_private=True, timeout_s=2.0)


def _png(seed: int = 1) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:          # noqa: N802 - http.server's name
        if self.path.startswith("/slow"):
            time.sleep(3)
        if self.path.startswith("/redirect-to-self"):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/cat.png")
            self.end_headers()
            return
        body = {"/cat.png": _png(), "/big.png": b"x" * 5000, "/corrupt.png": b"\x89PNG not really"}.get(
            self.path.split("?")[0], b"")
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):   # the client gave up (timeout test)
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.generated()


@pytest.fixture(scope="module")
def vision() -> VisionConfig:
    return VisionConfig.from_dict(tiny_config()["vision_config"])


def _request(url: str) -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})


def test_a_fetched_image_renders_as_its_data_url_and_is_inlined(server, tok, vision):
    options = SurfaceOptions(media=LOCAL)
    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    want = prepare_chat(_request(data_url), tok, vision, options)
    req = _request(server + "/cat.png")
    got = prepare_chat(req, tok, vision, options)
    assert got.token_ids == want.token_ids and got.image_spans() == want.image_spans()
    assert req.messages[0].content[0].image_url.url == data_url          # what the router forwards


def test_loopback_and_private_hosts_are_refused_by_default(server, tok, vision):
    for url in (server + "/cat.png", "http://localhost:1/x.png", "http://10.0.0.1/x.png", "http://[::1]/x.png",
                "http://169.254.169.254/latest/meta-data"):
        with pytest.raises(MediaFetchError, match="not a public address"):
            checked_address(url, MediaFetchLimits())
        with pytest.raises(InvalidRequest) as info:
            prepare_chat(_request(url), tok, vision)
        assert info.value.param == "messages"
        if "localhost" in url:                      # the client's host name, never what it resolved to
            assert "127.0.0.1" not in info.value.message and "::1" not in info.value.message


def test_redirects_are_checked_hop_by_hop(server):
    assert fetch_url_bytes(server + "/redirect-to-self", LOCAL) == _png()
    public_first = MediaFetchLimits(allowed_domains=("127.0.0.1",))    # allowed name, but a loopback address
    with pytest.raises(MediaFetchError, match="not a public address"):
        fetch_url_bytes(server + "/redirect-to-self", public_first)


def test_size_timeout_domains_and_switch(server):
    with pytest.raises(MediaFetchError, match="over this server's limit of 1000"):
        fetch_url_bytes(server + "/big.png", MediaFetchLimits(allow_private=True, max_bytes=1000))
    started = time.monotonic()
    with pytest.raises(MediaFetchError, match="timed out"):
        fetch_url_bytes(server + "/slow", MediaFetchLimits(allow_private=True, timeout_s=0.5))
    assert time.monotonic() - started < 2.0
    with pytest.raises(MediaFetchError, match="not one of this server's allowed media domains"):
        fetch_url_bytes(server + "/cat.png", MediaFetchLimits(allow_private=True, allowed_domains=("example.com",)))
    assert fetch_url_bytes(server + "/cat.png", MediaFetchLimits(allow_private=True, allowed_domains=("127.0.0.1",)))
    with pytest.raises(MediaFetchError, match="image URLs are off"):
        fetch_url_bytes(server + "/cat.png", MediaFetchLimits(allow_private=True, enabled=False))
    with pytest.raises(MediaFetchError, match="answered HTTP 404"):
        fetch_url_bytes(server + "/missing.png", LOCAL)


def test_a_corrupt_image_is_a_400_without_a_python_repr(server, tok, vision):
    for url in (server + "/corrupt.png", "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()):
        with pytest.raises(InvalidRequest) as info:
            prepare_chat(_request(url), tok, vision, SurfaceOptions(media=LOCAL))
        message = info.value.message
        assert "could not decode image" in message and " at 0x" not in message and "<" not in message, message
