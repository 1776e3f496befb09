"""Worker command-line flags, named after `vllm serve` where the meaning is the same. Torch-free, so
`kimi-pd` builds its whole parser (and runs the router) without loading the engine."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from shared.openai.surface import add_surface_args
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


def add_sharing_args(p: argparse.ArgumentParser) -> None:
    """How a worker shares its batch between requests, and how long a prefill state waits for a router."""
    p.add_argument("--kv-lease-s", type=float, default=30.0)
    p.add_argument("--request-share", type=float, default=0.5,
                   help="the share of --max-num-seqs one request's sequences (n, best_of, a prompt list) hold "
                        "while another request waits (0 < share <= 1; 1: no limit)")
    p.add_argument("--kv-renewed-lease-s", type=float, default=5.0,
                   help="a prefill state whose router renews it (ours, with an admin token) is freed this long "
                        "after the last renewal (a killed router's states go within seconds; --kv-lease-s bounds all)")


def add_worker_args(p: argparse.ArgumentParser, serve: bool = False) -> None:   # serve: vLLM's defaults
    add_vllm_serve_args(p, serve)                         # MODEL_PATH / --model first
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
    add_sharing_args(p)
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or None,
                   help=f"state store (registration, load, KV events; default ${REDIS_URL_ENV}, "
                        "which keeps a password off argv)")
    p.add_argument("--internal-auth", action=argparse.BooleanOptionalAction, default=None,
                   help="OpenAI endpoints need the internal token (KIMI_PD_ADMIN_TOKEN) or the API key; "
                        "default: on when the fleet has client keys ($KIMI_PD_API_KEYS) or $KIMI_PD_INTERNAL_AUTH=1")
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--log-level", default="info")
    _add_request_args(p)


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """What one request may send and cost, and vLLM's request-surface flags."""
    p.add_argument("--max-request-bytes", type=parse_bytes, default="16MiB",
                   help="largest request body; larger ones get a 413 before being parsed")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (slowloris guard)")
    p.add_argument("--max-structured-output-bytes", type=parse_bytes, default="64KiB",
                   help="largest JSON schema / regex / grammar a request may send (400 above)")
    p.add_argument("--structured-output-compile-timeout", type=float, default=10.0,
                   help="seconds a request's grammar may take to compile, off the engine thread (400 after)")
    add_surface_args(p)

# ---- `vllm serve` flags a vLLM command line carries (the seed's DP4/TP16/EP64 lines, deploy/ascend/seed.sh)
# whose effect here is partial or absent. Each is accepted with vLLM's name and values; the ones this
# device or build cannot apply say so in ONE start-up log line (`startup_notes`), never silently; an
# unknown flag is still an argparse error.

QUANT_DESCRIPTION_FILE = "quant_model_description.json"     # engine.checkpoint.layout's name (torch-free copy)
QUANTIZATION_METHODS = ("ascend",)
SAFETENSORS_LOAD_STRATEGIES = ("lazy", "eager", "prefetch", "torchao")     # vLLM 0.32's choices
AUTO_TOOL_CHOICE_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'

# Placeholder rows: data parallelism inside one engine belongs to the DP-attention work (issue 26, items 1-2);
# that change replaces these rows (and adds the flags). Until then the parser refuses the flags.
DP_PLACEHOLDER = "PLACEHOLDER (DP attention + EP across DP ranks): not implemented by this change"
DP_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
            "--data-parallel-address", "--data-parallel-rpc-port")

# What each flag of the seed's lines does HERE (docs/deployment.md "The seed's command lines" mirrors it).
SEED_FLAGS: dict[str, str] = {
    "MODEL_PATH": "the checkpoint directory (positional, as `vllm serve MODEL_PATH`; same as --model)",
    "--host": "HTTP bind address", "--port": "HTTP port", "--served-model-name": "the model name clients send",
    "--tokenizer": "directory the tokenizer files are read from (default: MODEL_PATH)",
    "--quantization": "`ascend`: MODEL_PATH must be a ModelSlim W4A8/W8A8 checkpoint; it runs on this build's "
                      "reference integer kernels (log line), not on Ascend NPU kernels",
    "--safetensors-load-strategy": "accepted; the loader here always reads shard by shard (log line)",
    "--tensor-parallel-size": "ranks sharing the model (engine/parallel), the DSpark draft included",
    "--enable-expert-parallel": "routed experts split whole across the ranks",
    "--max-model-len": "context limit; above the checkpoint's max_position_embeddings it is refused",
    "--max-num-batched-tokens": "tokens per engine step", "--max-num-seqs": "requests per engine step",
    "--gpu-memory-utilization": "accepted; the cache budget here is --cache-memory (log line)",
    "--enable-prefix-caching": "prefix caching with KDA snapshots",
    "--tokenizer-mode": "kimi_k3 (the only tokenizer)", "--reasoning-parser": "kimi_k3",
    "--tool-call-parser": "kimi_k3",
    "--enable-auto-tool-choice": "allows tool_choice \"auto\" (explicit, or implied by tools); without it a "
                                 "400 worded as vLLM's (`kimi-pd serve`; the worker roles default it on)",
    "--speculative-config": "DSpark; draft_tensor_parallel_size equal to the target's --tensor-parallel-size",
    "--headless": "ranks only, no HTTP server (today: the TP ranks of --nnodes; DP meaning: placeholder)",
    **dict.fromkeys(DP_FLAGS, DP_PLACEHOLDER),
}


def add_vllm_serve_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The positional MODEL_PATH and the seed's flags that `worker.flags` does not already have.

    serve: `kimi-pd serve` (vLLM's defaults: auto tool choice off unless asked for); the worker roles
    keep kimi-pd's default (on), which every kimi-pd fleet relies on."""
    p.add_argument("--model", help="checkpoint directory (default: the tiny generated one)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL_PATH",
                   help="checkpoint directory, as `vllm serve MODEL_PATH` (same as --model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="ascend: a ModelSlim W4A8/W8A8 checkpoint (run on the reference integer kernels here)")
    p.add_argument("--safetensors-load-strategy", default=None, choices=SAFETENSORS_LOAD_STRATEGIES,
                   help="accepted for vLLM command lines; the loader here always reads shard by shard")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="accepted for vLLM command lines; the KV/state cache budget here is --cache-memory")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=not serve,
                   help='allow tool_choice "auto" (also implied by tools without tool_choice); without it such '
                        f"a request is a 400 (default: {'off, as vLLM' if serve else 'on'})")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def resolve_model(args: argparse.Namespace) -> str | None:
    """MODEL_PATH (positional) or --model; both given must name the same directory."""
    positional, flag = getattr(args, "model_path", None), args.model
    if positional and flag and Path(positional).resolve() != Path(flag).resolve():
        raise ValueError(f"MODEL_PATH {positional} and --model {flag} name different checkpoints: give one")
    return positional or flag


def check_quantization(args: argparse.Namespace, model_dir: str) -> None:
    """`--quantization ascend` on a checkpoint that is not ModelSlim fails as vLLM-Ascend does: at start-up."""
    if args.quantization == "ascend" and not (Path(model_dir) / QUANT_DESCRIPTION_FILE).is_file():
        raise ValueError(f"--quantization ascend needs a ModelSlim checkpoint ({QUANT_DESCRIPTION_FILE} in "
                         f"{model_dir}); this one is not quantized: drop the flag, or quantize it first "
                         "(kimi-pd checkpoint quantize)")


def startup_notes(args: argparse.Namespace) -> list[str]:
    """One line per given flag whose vLLM effect is partial or absent here (logged at start-up)."""
    notes = []
    if args.quantization:
        notes.append(f"--quantization {args.quantization}: ModelSlim W4A8/W8A8 weights run on this build's "
                     "reference integer kernels (exact int32 products), not on Ascend NPU kernels")
    if args.safetensors_load_strategy:
        notes.append(f"--safetensors-load-strategy {args.safetensors_load_strategy}: accepted, no effect here: the "
                     "loader always reads shard by shard, one tensor at a time (peak: the model plus one tensor)")
    if args.gpu_memory_utilization is not None:
        notes.append(f"--gpu-memory-utilization {args.gpu_memory_utilization}: accepted, no effect here: the "
                     f"KV/state cache budget is --cache-memory ({args.cache_memory} bytes), on {args.device} "
                     "as on accelerators")
    return notes
