"""Worker flags (`worker.flags`) -> WorkerSettings, and the process: uvicorn that drains on SIGTERM."""
from __future__ import annotations

import argparse
import logging

import uvicorn

from engine.core.engine import EngineConfig
from engine.structured_output import GrammarBudget
from shared.http_server import protocol_class
from shared.openai.surface import surface_from_args
from worker.flags import add_worker_args, check_quantization, resolve_model, startup_notes
from worker.role import Role
from worker.settings import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    TRANSFER_SECRET_ENV,
    WorkerSettings,
    internal_auth_default,
    secret_from_env,
)

log = logging.getLogger(__name__)


def settings_from_args(args: argparse.Namespace, model_dir: str) -> WorkerSettings:
    from engine.spec_decode.config import SpeculativeConfig
    speculative = SpeculativeConfig.parse(args.speculative_config)     # a bad config stops start-up here
    secret = secret_from_env(TRANSFER_SECRET_ENV) or ""
    engine = EngineConfig(model=model_dir, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          request_share=args.request_share,
                          enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
                          device=args.device, dtype=args.dtype, cache_memory_bytes=args.cache_memory,
                          kda_chunk_size=args.kda_chunk_size,
                          export_lease_s=None,                      # the transfer lease is the one clock
                          model_id=args.served_model_name, speculative_config=speculative,
                          tensor_parallel_size=args.tensor_parallel_size,
                          enable_expert_parallel=args.enable_expert_parallel, master_addr=args.master_addr,
                          master_port=args.master_port, nnodes=args.nnodes, node_rank=args.node_rank,
                          compilation_config=args.compilation_config, enforce_eager=args.enforce_eager,
                          scheduling_policy=args.scheduling_policy, tokenizer=args.tokenizer)
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerSettings(engine=engine, host=args.host, port=args.port,
                          served_model_name=args.served_model_name, advertise_url=args.advertise_url,
                          transfer_transport=args.kv_transport, transfer_host=args.kv_host,
                          transfer_advertise_host=args.kv_advertise_host,
                          transfer_port=args.kv_port, transfer_streams=args.kv_streams,
                          transfer_secret=secret.encode(), kv_lease_s=args.kv_lease_s,
                          kv_renewed_lease_s=args.kv_renewed_lease_s,
                          kv_load_failure_policy=args.kv_load_failure_policy, store_url=args.redis_url,
                          namespace=args.namespace, heartbeat_s=args.heartbeat_s,
                          max_request_bytes=args.max_request_bytes,
                          grammar_budget=GrammarBudget(args.max_structured_output_bytes,
                                                       args.structured_output_compile_timeout),
                          internal_auth=internal_auth_default() if args.internal_auth is None else args.internal_auth,
                          api_key=secret_from_env(API_KEY_ENV),
                          admin_token=secret_from_env(ADMIN_TOKEN_ENV) or None,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          surface=surface_from_args(args), **extra)


def checked_settings(args: argparse.Namespace, model_dir: str) -> WorkerSettings:
    """The settings, after the checks vLLM makes at start-up, with one log line per vLLM flag whose
    effect is partial or absent here (worker.flags)."""
    check_quantization(args, model_dir)
    for note in startup_notes(args):
        log.warning("%s", note)
    return settings_from_args(args, model_dir)


def run_worker(args: argparse.Namespace, role: Role, model_dir: str) -> int:
    from worker.app import create_app
    from worker.runtime import WorkerRuntime

    settings = checked_settings(args, model_dir)
    if args.headless:
        from engine.parallel.launch import run_headless
        return run_headless(settings.engine)
    runtime = WorkerRuntime.build(settings, role)
    config = uvicorn.Config(create_app(runtime), host=settings.host, port=settings.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=30, http=protocol_class(args.header_timeout))
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


def main(role: Role, argv: list[str] | None = None) -> int:
    """A worker of `role` on its own (`python -m prefill_worker`); `kimi-pd prefill` is the same."""
    import sys

    from shared.logs import configure_logging
    parser = argparse.ArgumentParser(prog=f"python -m {role.name}_worker", allow_abbrev=False,
                                     description=f"kimi-pd {role.name} worker")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        model = resolve_model(args)
        if not model:
            parser.error("MODEL_PATH (or --model) is required")
        return run_worker(args, role, model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
