"""`kimi-pd router` flags -> RouterSettings; secrets from the environment only."""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

from router.kv_events_relay import parse_kv_events_flag
from router.settings import RouterSettings
from shared.env import ADMIN_TOKEN_ENV, CLIENT_KEYS_ENV
from shared.openai.surface import add_surface_args, surface_from_args
from shared.store.factory import REDIS_URL_ENV

API_KEYS_ENV = CLIENT_KEYS_ENV            # comma-separated client keys (optional)
WORKER_API_KEY_ENV = "KIMI_PD_WORKER_API_KEY"  # the key workers expect (their KIMI_PD_API_KEY), if any
WORKERS_ENV = "KIMI_PD_ROUTER_WORKERS"      # default of --workers (tests set 1: their routers are one process)


def _add_request_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body; larger ones get a 413 before being parsed or tokenised")
    p.add_argument("--max-sequences-per-request", type=int, default=1024,
                   help="prompts x n (or best_of) of one request; more get a 400 (at most 1024)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="for prompt hashing: a Kimi-K3 checkpoint or any Hugging Face tokenizer "
                                   "directory (tokenizer.json + its chat template); default: the tiny generated K3 one")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="run without a tokenizer: the prefix index hashes prompt text (approximate)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=_env_workers(), metavar="N",
                   help=f"router processes serving the port, placing as one router (default: ${WORKERS_ENV}, else "
                        "the cores this process may use, within its cgroup's CPU quota; 1: a single process, no "
                        "parent): docs/router-processes.md")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds open streams get to finish on SIGTERM before the router stops")
    p.add_argument("--served-model-name", nargs="+", default=["kimi-k3"], metavar="NAME",
                   help="names clients may use; the first is the workers' own (sent to them), as in vLLM")
    p.add_argument("--kv-connector", default="kimi-pd",
                   help="P/D protocol of the static workers: kimi-pd (ours), or a stock vLLM connector: "
                        "nixl, mooncake (vLLM's: the router makes the transfer id), mooncake-ascend, "
                        "p2p-nccl, lmcache, example (shared storage)")
    p.add_argument("--mooncake-bootstrap-port", type=int, default=8998,
                   help="--kv-connector mooncake: the port of each prefill's bootstrap server "
                        "(vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT), on the prefill's host")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                   help="a static vLLM worker's ZMQ KV events (its --kv-events-config endpoint, e.g. "
                        "http://10.0.0.5:8100=tcp://10.0.0.5:5557): an exact prefix index for it (needs pyzmq)")
    add_static_worker_args(p)
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0,
                   help="starting guess of a worker's prefill speed; calibrated from its answers")
    _add_request_limits(p)
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or None,
                   help=f"state store: discover workers, load, KV events (default ${REDIS_URL_ENV}; "
                        "redis://:PASSWORD@HOST:PORT, and the environment keeps the password out of `ps`)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--disagg-threshold", type=int, default=32,
                   help="decode-only when fewer prompt tokens than this are uncached on the decode worker")
    p.add_argument("--transfer-aware", action=argparse.BooleanOptionalAction, default=False,
                   help="also decode-only when the decode worker's measured state pulls say moving the prompt's "
                        "state takes longer than it would take to prefill the uncached tokens itself")
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--prefill-timeout", type=float, default=120.0)
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--placement-headers", action=argparse.BooleanOptionalAction, default=None,
                   help="name the prefill/decode workers of each answer in x-kimi-pd-*-worker headers "
                        "(default: only when no client API keys are set)")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants, their API keys and limits (TOML or JSON; re-read when it changes): docs/admission.md")
    p.add_argument("--max-inflight-per-worker", type=int, default=0,
                   help="admission queue: requests in flight per usable decode worker before new ones wait "
                        "(0: no queue)")
    p.add_argument("--max-queued", type=int, default=1024, help="admission queue bound (a full queue answers 503)")
    p.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request may wait in the admission queue before a 503 with Retry-After")
    p.add_argument("--health-check-interval", type=float, default=2.0)
    p.add_argument("--health-check-timeout", type=float, default=2.0,
                   help="seconds a worker has to answer one /health probe (two misses in a row: unhealthy)")
    p.add_argument("--refresh-interval", type=float, default=0.5, help="state store polling")
    p.add_argument("--log-level", default="info")
    _add_front_args(p)


def _add_front_args(p: argparse.ArgumentParser) -> None:
    """The HTTP front: the slowloris guard and vLLM's request-surface flags."""
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (slowloris guard)")
    add_surface_args(p)


def add_static_worker_args(p: argparse.ArgumentParser) -> None:
    """Workers given by URL (no store registration): their roles, data-parallel ranks and cache shape."""
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="static prefill worker")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="static decode worker")
    p.add_argument("--worker", action="append", default=[], metavar="URL", help="static colocated worker")
    p.add_argument("--data-parallel-ranks", action="append", default=[], metavar="URL=D",
                   help="a static worker whose API server fronts D data-parallel ranks (vLLM --data-parallel-size D "
                        "behind one server): placed on as D workers (prefix index and load per rank), each request "
                        "pinned to its rank with the X-data-parallel-rank header")
    p.add_argument("--block-size", type=int, default=16, help="block size of static workers")
    p.add_argument("--static-cache-tokens", type=int, default=0,
                   help="KV cache size of each static worker in tokens (default: read from its /metrics)")
    p.add_argument("--kv-pool-blocks", type=int, default=0,
                   help="the prefill workers share a KV pool of this many KV blocks (vLLM-Ascend's "
                        "AscendStoreConnector, Mooncake Store, LMCache): placement counts a prefix any of them "
                        "computed as a cheap hit on all of them (default 0: no pool)")
    p.add_argument("--kv-pool-load-cost", type=float, default=0.1,
                   help="what loading a token from the KV pool costs a worker, as a share of computing it (0-1]")


def settings_from_args(args: argparse.Namespace, model_dir: str | None) -> RouterSettings:
    keys = tuple(k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip())
    return RouterSettings(model=model_dir, host=args.host, port=args.port, served_model_name=args.served_model_name[0],
                          served_model_aliases=tuple(args.served_model_name[1:]), kv_connector=args.kv_connector,
                          mooncake_bootstrap_port=args.mooncake_bootstrap_port,
                          kv_events=parse_kv_events_flag(args.kv_events),
                          static_prefill=tuple(args.prefill), static_decode=tuple(args.decode),
                          static_both=tuple(args.worker), static_dp_ranks=parse_dp_ranks(args.data_parallel_ranks),
                          block_size=args.block_size, store_url=args.redis_url,
                          static_cache_tokens=args.static_cache_tokens, max_request_bytes=args.max_request_bytes,
                          max_sequences_per_request=args.max_sequences_per_request,
                          prefill_tokens_per_s=args.prefill_tokens_per_s,
                          kv_pool_blocks=args.kv_pool_blocks, kv_pool_load_cost=args.kv_pool_load_cost,
                          namespace=args.namespace, disagg_threshold_tokens=args.disagg_threshold,
                          transfer_aware=args.transfer_aware,
                          max_attempts=args.max_attempts, connect_timeout_s=args.connect_timeout,
                          prefill_timeout_s=args.prefill_timeout, idle_timeout_s=args.idle_timeout,
                          health_check_s=args.health_check_interval,
                          health_timeout_s=args.health_check_timeout, refresh_s=args.refresh_interval, api_keys=keys,
                          placement_headers=args.placement_headers, tenants_file=args.tenants,
                          max_inflight_per_worker=args.max_inflight_per_worker, max_queued=args.max_queued,
                          queue_timeout_s=args.queue_timeout,
                          admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
                          worker_api_key=os.environ.get(WORKER_API_KEY_ENV) or None, surface=surface_from_args(args))


def parse_dp_ranks(values: list[str]) -> tuple[tuple[str, int], ...]:
    """`--data-parallel-ranks URL=D` values -> ((URL, D), ...); ValueError names a malformed one."""
    out = []
    for value in values:
        url, _, ranks = value.rpartition("=")
        if not url or not ranks.isdigit():
            raise ValueError(f"--data-parallel-ranks {value!r}: give URL=D, D a number of ranks")
        out.append((url, int(ranks)))
    return tuple(out)


def _env_workers() -> int | None:
    value = os.environ.get(WORKERS_ENV, "").strip()
    return int(value) if value.isdigit() else None


def usable_cores() -> int:
    """The cores this process may run on (its affinity), no more than its cgroup v2 CPU quota allows (a
    container limited to 2 CPUs on a 64-core node sees all 64 in its affinity)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def router_processes(requested: int | None) -> int:
    """`--workers`: N as given, or one per usable core."""
    n = requested if requested is not None else usable_cores()
    if not 1 <= n <= 256:
        raise ValueError(f"--workers {n}: give 1..256 router processes")
    return n


def run_router(args: argparse.Namespace, model_dir: str | None) -> int:
    n = router_processes(args.workers)
    if args.shutdown_timeout <= 0:
        raise ValueError("--shutdown-timeout must be > 0")
    if n == 1:
        serve(args, model_dir)
        return 0
    settings_from_args(args, model_dir).validate()        # a bad flag stops here, before any child starts
    from router.procs.supervisor import run_processes
    return run_processes(args, model_dir, n, args.shutdown_timeout, serve)


def serve(args: argparse.Namespace, model_dir: str | None, share: Any = None, sockets: list | None = None,
          grace_s: float | None = None) -> None:
    """One router process: on host:port, or on `sockets` inherited from the parent of `--workers N`."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from router.app import create_app
    from router.transport.front import front_protocol_class
    from router.transport.heap import settle_after_startup
    settings = settings_from_args(args, model_dir)
    app = create_app(settings, share=share)
    settle_after_startup(app)                     # this process serves it: GC settings after start-up
    grace = math.ceil(args.shutdown_timeout if grace_s is None else max(grace_s - 2.0, 1.0))   # parent kills at grace_s
    # the two OpenAI POST routes are served by the protocol itself (router/transport/front.py); the rest by the app
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=grace, log_config=None if share is not None else LOGGING_CONFIG,
                            http=front_protocol_class(args.header_timeout, app, settings.max_request_bytes))
    uvicorn.Server(config).run(sockets=sockets)
