"""A follower rank: `python -m engine.parallel.follower --rank R --port P --config JSON`.

Loads the checkpoint, keeps its shard, then replays rank 0's commands until told to stop. It exits
on its own if rank 0's process goes away (parent watch), so a killed engine never leaves ranks behind.
"""
from __future__ import annotations

import logging

from engine.parallel.rank_process import rank_parser, start_rank

log = logging.getLogger("engine.parallel.follower")


def main() -> int:
    parser = rank_parser(__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config = start_rank(args)
    from engine.parallel.comm import rank_device
    from engine.parallel.launch import build_rank
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
