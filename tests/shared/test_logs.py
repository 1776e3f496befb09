"""Health probes and load scrapes are HTTP requests the router makes every second or two: at the INFO
level a fleet runs at, they log nothing (httpx would log each one, naming internal worker addresses)."""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from shared.logs import CHATTY_CLIENTS, configure_logging


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:          # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


def test_probes_are_silent_at_info_and_visible_at_debug(caplog):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    root = logging.getLogger()
    before = root.level, [logging.getLogger(n).level for n in CHATTY_CLIENTS]
    try:
        for level, logged in (("info", False), ("debug", True)):
            root.setLevel(level.upper())            # basicConfig does not reset a configured root
            configure_logging(level)
            caplog.clear()
            with caplog.at_level(level.upper()):
                httpx.get(f"http://127.0.0.1:{httpd.server_port}/health", timeout=5)
            assert any("/health" in r.getMessage() for r in caplog.records) == logged, level
    finally:
        httpd.shutdown()
        root.setLevel(before[0])
        for name, lvl in zip(CHATTY_CLIENTS, before[1], strict=True):
            logging.getLogger(name).setLevel(lvl)
