"""Process logging, set once at each command's edge (the `kimi-pd` command and a worker run alone)."""
from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# HTTP clients that log every request at INFO: each health probe, load scrape and leg would be a line
# (every 0.3-2 s per worker) naming internal worker addresses. They speak at WARNING unless asked for DEBUG.
CHATTY_CLIENTS = ("httpx", "httpcore")


def configure_logging(level: str, fmt: str = LOG_FORMAT) -> None:
    logging.basicConfig(level=level.upper(), format=fmt)
    quiet = logging.getLogger().getEffectiveLevel() > logging.DEBUG
    for name in CHATTY_CLIENTS:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)
