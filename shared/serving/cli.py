"""Worker command-line flags (named after `vllm serve` where the meaning is the same) -> WorkerSettings."""
from __future__ import annotations

import argparse
import re

import uvicorn

from engine.core.engine import EngineConfig
from shared.serving.settings import API_KEY_ENV, TRANSFER_SECRET_ENV, WorkerSettings, secret_from_env

_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
ACCEPTED_PARSERS = ("kimi_k3",)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the tiny generated one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--served-model-name", default="kimi-k3")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-memory", type=parse_bytes, default="256MiB", help="KV/state cache budget")
    p.add_argument("--kda-chunk-size", type=int, default=64)
    p.add_argument("--speculative-config", default=None,
                   help='JSON, vLLM\'s fields: {"method": "dspark", "model": DRAFT_DIR, "num_speculative_tokens": 7, '
                        '"draft_sample_method": "greedy"|"probabilistic", "max_model_len": N, ...}')
    p.add_argument("--tokenizer-mode", default="kimi_k3", choices=["auto", "kimi_k3"])
    p.add_argument("--reasoning-parser", default="kimi_k3", choices=ACCEPTED_PARSERS)
    p.add_argument("--tool-call-parser", default="kimi_k3", choices=ACCEPTED_PARSERS)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--advertise-url", default=None, help="URL routers should use (default http://HOST:PORT)")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake", "torch-dist"])
    p.add_argument("--kv-host", default="127.0.0.1")
    p.add_argument("--kv-port", type=int, default=0)
    p.add_argument("--kv-streams", type=int, default=4)
    p.add_argument("--kv-lease-s", type=float, default=30.0)
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    p.add_argument("--redis-url", default=None, help="state store (registration, load, KV events)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--log-level", default="info")


def settings_from_args(args: argparse.Namespace, role: str, model_dir: str) -> WorkerSettings:
    from engine.spec_decode.config import SpeculativeConfig
    speculative = SpeculativeConfig.parse(args.speculative_config)     # a bad config stops start-up here
    secret = secret_from_env(TRANSFER_SECRET_ENV) or ""
    engine = EngineConfig(model=model_dir, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
                          device=args.device, dtype=args.dtype, cache_memory_bytes=args.cache_memory,
                          kda_chunk_size=args.kda_chunk_size, export_lease_s=args.kv_lease_s + 30.0,
                          model_id=args.served_model_name, speculative_config=speculative)
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerSettings(role=role, engine=engine, host=args.host, port=args.port,
                          served_model_name=args.served_model_name, advertise_url=args.advertise_url,
                          transfer_transport=args.kv_transport, transfer_host=args.kv_host,
                          transfer_port=args.kv_port, transfer_streams=args.kv_streams,
                          transfer_secret=secret.encode(), kv_lease_s=args.kv_lease_s,
                          kv_load_failure_policy=args.kv_load_failure_policy, store_url=args.redis_url,
                          namespace=args.namespace, heartbeat_s=args.heartbeat_s,
                          api_key=secret_from_env(API_KEY_ENV), **extra)


def run_worker(args: argparse.Namespace, role: str, model_dir: str) -> int:
    from shared.serving.app import create_app
    from shared.serving.runtime import WorkerRuntime

    settings = settings_from_args(args, role, model_dir)
    runtime = WorkerRuntime.build(settings)
    config = uvicorn.Config(create_app(runtime), host=settings.host, port=settings.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=30)
    DrainingServer(config, runtime).run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first deregisters the worker (routers stop sending), then drains."""

    def __init__(self, config: uvicorn.Config, runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.runtime.begin_drain()
        super().handle_exit(sig, frame)
