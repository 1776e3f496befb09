"""A follower rank: `python -m engine.parallel.follower --rank R --port P --config JSON`.

Loads the checkpoint, keeps its shard, then replays rank 0's commands until told to stop. It exits
on its own if rank 0's process goes away (parent watch), so a killed engine never leaves ranks behind.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

import torch

log = logging.getLogger("engine.parallel.follower")


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.core.engine import EngineConfig
    from engine.parallel.comm import rank_device
    from engine.parallel.launch import build_rank
    config = EngineConfig(**json.loads(args.config))
    group, model = build_rank(config, args.rank, args.port)
    try:
        cache_config, identity = group.broadcast()
        from engine.parallel.runner import ShardedRunner
        runner = ShardedRunner(model, cache_config, identity, group)
        from engine.graphs.config import CompilationConfig
        from engine.graphs.decode import setup_decode_graphs
        setup_decode_graphs(runner, model, rank_device(config.device, args.rank), config.max_num_seqs,
                            CompilationConfig.parse(config.compilation_config), config.enforce_eager)
        while runner.apply(group.broadcast()):
            pass
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
