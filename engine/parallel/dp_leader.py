"""A data-parallel leader: `python -m engine.parallel.dp_leader --rank G --config JSON`.

DP rank d = G / T's rank 0 (d > 0): it loads its shard, runs a whole `LLMEngine` (scheduler, batch,
cache) and answers the front's commands (`dp_rank.serve`) until told to stop. It exits on its own if
its parent goes away (the launcher on its host), and with an error when the front's connection breaks.
"""
from __future__ import annotations

import logging

from engine.parallel.rank_process import rank_parser, start_rank

log = logging.getLogger("engine.parallel.dp_leader")


def main() -> int:
    args = rank_parser(__doc__, "global rank (a multiple of the TP size)").parse_args()
    config = start_rank(args)
    from engine.core.engine import LLMEngine
    from engine.parallel.dp_rank import DPRank, serve
    from engine.parallel.launch import build_dp_rank
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
