"""`vllm serve` flags a vLLM command line carries (the seed's DP4/TP16/EP64 lines, deploy/ascend/seed.sh)
whose effect here is partial or absent. Each is accepted with vLLM's name and values; the ones this
device or build cannot apply say so in ONE start-up log line (`startup_notes`), never silently; an
unknown flag is still an argparse error. Torch-free, like `worker.flags`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

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
