"""A data-parallel leader: `python -m engine.parallel.dp_leader --rank G --config JSON`.

DP rank d = G / T's rank 0 (d > 0): it loads its shard, runs a whole `LLMEngine` (scheduler, batch,
cache) and answers the front's commands (`dp_rank.serve`) until told to stop. It exits on its own if
its parent goes away (the launcher on its host), and with an error when the front's connection breaks.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

import torch

log = logging.getLogger("engine.parallel.dp_leader")


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="global rank (a multiple of the TP size)")
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.core.engine import EngineConfig, LLMEngine
    from engine.parallel.dp_rank import DPRank, serve
    from engine.parallel.launch import build_dp_rank
    config = EngineConfig(**json.loads(args.config))
    group, model, channel = build_dp_rank(config, args.rank)
    dp_rank = args.rank // config.tensor_parallel_size
    engine = LLMEngine(config, parallel=DPRank(group, model, channel))
    assert channel is not None
    log.info("data-parallel rank %d ready", dp_rank)
    try:
        serve(engine, channel, dp_rank)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
