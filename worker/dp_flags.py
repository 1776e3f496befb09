"""The data-parallel flags of `vllm serve`, with its meaning (a module of their own, beside `flags.py`).

`--data-parallel-size D` runs D engines (DP ranks: each its own scheduler, batch and cache) whose
routed experts spread over all D x TP ranks. A host runs `--data-parallel-size-local` of them from
`--data-parallel-start-rank`; the node with start rank 0 serves HTTP and places requests, the others
run `--headless` (ranks only) and join it at `--data-parallel-address:--data-parallel-rpc-port`.
Torch-free: the router's parser loads nothing.
"""
from __future__ import annotations

import argparse

VLLM_DEFAULT_RPC_PORT = 29550       # vLLM's --data-parallel-rpc-port default, used when hosts must meet


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="data-parallel ranks (engines, each with its own batch and cache) sharing the experts")
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="DP ranks on this host (default: all of them from --data-parallel-start-rank)")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="the first DP rank this host runs (> 0 on --headless nodes)")
    p.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="node 0's address, where every DP rank meets (default --master-addr)")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                   help=f"the port on --data-parallel-address for the ranks and the front's commands "
                        f"(default: any free port on one host, {VLLM_DEFAULT_RPC_PORT} across hosts, as vLLM)")


def data_parallel_settings(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the parsed flags."""
    size, local = args.data_parallel_size, args.data_parallel_size_local
    across_hosts = local is not None and local < size
    port = args.data_parallel_rpc_port
    if port is None:
        port = VLLM_DEFAULT_RPC_PORT if across_hosts or args.headless else 0
    return {"data_parallel_size": size, "data_parallel_size_local": local,
            "data_parallel_start_rank": args.data_parallel_start_rank,
            "data_parallel_address": args.data_parallel_address or args.master_addr,
            "data_parallel_rpc_port": port}
