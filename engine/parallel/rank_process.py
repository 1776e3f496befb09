"""The start every rank process shares (`follower`, `dp_leader`): one command line (its global rank, the
engine's EngineConfig as JSON, torch threads), a watch that ends the process when its parent (the engine
or the launcher on its host) goes away, so a killed engine never leaves ranks behind, and the config."""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.engine import EngineConfig


def rank_parser(description: str | None, rank_help: str | None = None) -> argparse.ArgumentParser:
    """--rank, --config and --threads; a rank process adds what it alone takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rank", type=int, required=True, help=rank_help)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def start_rank(args: argparse.Namespace) -> EngineConfig:
    """Start the parent watch, apply --threads, and return the parsed EngineConfig."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.core.engine import EngineConfig
    return EngineConfig(**json.loads(args.config))
