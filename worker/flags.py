"""Worker command-line flags, named after `vllm serve` where the meaning is the same. Torch-free, so
`kimi-pd` builds its whole parser (and runs the router) without loading the engine."""
from __future__ import annotations

import argparse
import os
import re

from shared.store.factory import REDIS_URL_ENV

_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
ACCEPTED_PARSERS = ("kimi_k3",)
_POLICY_HELP = ("fcfs: arrival order; priority: the request's `priority` (lower first, then arrival), preempting "
                "the lowest under memory pressure (vLLM's)")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_multi_host_args(p: argparse.ArgumentParser) -> None:
    """One tensor-parallel engine over several hosts (vLLM's and torchrun's names)."""
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="ranks on several hosts: node 0's address, where every rank meets (torch.distributed's)")
    p.add_argument("--master-port", type=int, default=0, help="the rendezvous port on --master-addr (0: any, one host)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks are spread over (evenly)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index; node 0 holds rank 0 and serves")
    p.add_argument("--headless", action="store_true",
                   help="run only this node's ranks (node-rank > 0): no HTTP server, no registration")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the tiny generated one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--served-model-name", default="kimi-k3")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"], help=_POLICY_HELP)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-memory", type=parse_bytes, default="256MiB", help="KV/state cache budget")
    p.add_argument("--kda-chunk-size", type=int, default=64)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, vLLM\'s fields: {"method": "dspark", "model": DRAFT_DIR, "num_speculative_tokens": 7, '
                        '"draft_sample_method": "greedy"|"probabilistic", "max_model_len": N, ...}')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (processes, one device each) sharing the model; gloo on CPU, nccl/hccl on accelerators")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split the routed experts whole across the tensor-parallel ranks")
    add_multi_host_args(p)
    p.add_argument("--compilation-config", default=None,
                   help='JSON, vLLM\'s fields: {"cudagraph_mode": "FULL_DECODE_ONLY", '
                        '"cudagraph_capture_sizes": [1, 2, 4, 8]}')
    p.add_argument("--enforce-eager", action="store_true", help="never capture decode graphs")
    p.add_argument("--tokenizer-mode", default="kimi_k3", choices=["auto", "kimi_k3"])
    p.add_argument("--reasoning-parser", default="kimi_k3", choices=ACCEPTED_PARSERS)
    p.add_argument("--tool-call-parser", default="kimi_k3", choices=ACCEPTED_PARSERS)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--advertise-url", default=None, help="URL routers should use (default http://HOST:PORT)")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake", "torch-dist"])
    p.add_argument("--kv-host", default="127.0.0.1",
                   help="where the KV transfer server listens (0.0.0.0: every interface)")
    p.add_argument("--kv-advertise-host", default=None,
                   help="the address decode workers pull KV state from (default --kv-host; required when that "
                        "is 0.0.0.0)")
    p.add_argument("--kv-port", type=int, default=0)
    p.add_argument("--kv-streams", type=int, default=2,
                   help="parallel TCP streams per pull (2 x 8 MiB chunks measured best on 2 cores)")
    p.add_argument("--kv-lease-s", type=float, default=30.0)
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or None,
                   help=f"state store (registration, load, KV events; default ${REDIS_URL_ENV}, "
                        "which keeps a password off argv)")
    p.add_argument("--internal-auth", action=argparse.BooleanOptionalAction, default=None,
                   help="OpenAI endpoints need the internal token (KIMI_PD_ADMIN_TOKEN) or the API key; "
                        "default: on when the fleet has client keys ($KIMI_PD_API_KEYS) or $KIMI_PD_INTERNAL_AUTH=1")
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--max-request-bytes", type=parse_bytes, default="16MiB",
                   help="largest request body; larger ones get a 413 before being parsed")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (slowloris guard)")
    p.add_argument("--max-structured-output-bytes", type=parse_bytes, default="64KiB",
                   help="largest JSON schema / regex / grammar a request may send (400 above)")
    p.add_argument("--structured-output-compile-timeout", type=float, default=10.0,
                   help="seconds a request's grammar may take to compile, off the engine thread (400 after)")
    p.add_argument("--log-level", default="info")
