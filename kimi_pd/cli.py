"""`kimi-pd` command line: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TypeAlias

from shared.logs import configure_logging

DEFAULT_TINY_DIR = Path("checkpoints/tiny")
# Kept in step with engine.training (not imported here: the parser must build without torch loaded).
FAMILY_NAMES = ("add", "sub", "reverse", "sort", "tool_call", "tool_answer", "multi_turn")
TRAIN_STEPS = 2800
TRAIN_WORKERS = 2
_DTYPES = ("float32", "bfloat16")


def _checkpoint_create(args: argparse.Namespace) -> int:
    if args.draft:
        if not args.target:
            raise ValueError("--draft needs --target DIR (the checkpoint the draft speculates for)")
        from engine.spec_decode.checkpoint import create_draft_checkpoint
        print(create_draft_checkpoint(args.target, args.out, block=args.block or 7, seed=args.seed,
                                      attention=args.attention))
        return 0
    if args.target or args.block is not None or args.attention != "mla":
        raise ValueError("--target, --block and --attention describe a draft: add --draft")
    if args.preset.startswith("tiny-chat-dspark"):
        if args.seed or args.quant:
            raise ValueError("--seed/--quant do not apply to the trained tiny-chat-dspark draft (fixed weights; "
                             "retrain with `kimi-pd checkpoint train-draft`)")
        from engine.spec_decode.checkpoint import copy_shipped_draft
        print(copy_shipped_draft(args.preset, args.out))
        return 0
    from engine.checkpoint.create import create_checkpoint
    out = create_checkpoint(args.preset, args.out, seed=args.seed, quant=args.quant, progress=not args.quiet)
    print(out)
    return 0


def _checkpoint_train_draft(args: argparse.Namespace) -> int:
    from engine.spec_decode.train import DraftTrainConfig, train_draft
    out = args.out or f"{str(args.target).rstrip('/')}-dspark"
    cfg = DraftTrainConfig(block=args.block, steps=args.steps, num_sequences=args.sequences, seed=args.seed,
                           threads=args.threads, attention=args.attention)
    result = train_draft(args.target, out, cfg, progress=not args.quiet)
    print(json.dumps({"out": str(out), **{k: v for k, v in result.items() if k != "config"}}))
    return 0


def _checkpoint_train(args: argparse.Namespace) -> int:
    from engine.training.train import TrainConfig, train
    cfg = TrainConfig(seed=args.seed, steps=args.steps, workers=args.workers)
    result = train(cfg, args.out, progress=not args.quiet)
    print(f"trained {result['num_params']:,} parameters for {cfg.steps} steps in {result['seconds']:.0f} s "
          f"(final loss {sum(result['losses'][-20:]) / 20:.4f}); checkpoint, loss.png and train_log.json in {args.out}")
    return 0


def _checkpoint_eval(args: argparse.Namespace) -> int:
    from engine.training.evaluate import evaluate, format_scores, offline_answerer, router_answerer
    from engine.training.tasks import FAMILIES
    families = args.family or list(FAMILIES)
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.thinking]
    if args.url:
        answerer, where = router_answerer(args.url), f"router {args.url}"
    else:
        model = str(_default_chat_model(args.model))
        answerer, where = offline_answerer(model), f"offline LLM, {model}"
    scores = evaluate(answerer, families, args.n, modes)
    if args.json:
        print(json.dumps([{"family": s.family, "thinking": s.thinking, "correct": s.correct, "total": s.total,
                           "accuracy": s.accuracy} for s in scores]))
    else:
        print(format_scores(scores, where))
    return 0


def _default_chat_model(path: str | None) -> Path:
    """`--model` or the shipped trained `tiny-chat` checkpoint (package data, read in place)."""
    from engine.presets import shipped_checkpoint
    return Path(path) if path else shipped_checkpoint("tiny-chat")


def _checkpoint_quantize(args: argparse.Namespace) -> int:
    from engine.checkpoint.quantize import quantize_checkpoint
    print(quantize_checkpoint(args.src, args.out, progress=not args.quiet))
    return 0


def _ensure_model(path: str | None) -> Path:
    """`--model` or, by default, the tiny generated checkpoint (created on first use)."""
    if path:
        return Path(path)
    if not (DEFAULT_TINY_DIR / "config.json").exists():
        from engine.checkpoint.create import create_checkpoint
        print(f"no --model given: writing the tiny generated checkpoint to {DEFAULT_TINY_DIR}", file=sys.stderr)
        create_checkpoint("tiny", DEFAULT_TINY_DIR)
    return DEFAULT_TINY_DIR


def _generate(args: argparse.Namespace) -> int:
    from engine.generate import generate_one
    from shared.prompt.images import load_image

    images = [load_image(path) for path in args.image]
    result = generate_one(_ensure_model(args.model), args.prompt, images, args.max_tokens, args.temperature,
                          args.seed, args.dtype, args.thinking)
    out = result.output
    if args.json:
        print(json.dumps({"prompt_token_ids": result.prompt_token_ids, "token_ids": out.token_ids,
                          "logprobs": out.logprobs, "text": out.text, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _worker(command: str):
    def run(args: argparse.Namespace) -> int:
        from kimi_pd.roles import COMMANDS
        from worker.cli import run_worker
        from worker.flags import resolve_model
        role = COMMANDS["worker" if command == "serve" else command]        # serve: vLLM's colocated server
        return run_worker(args, role, str(_ensure_model(resolve_model(args))))
    return run


def _router(args: argparse.Namespace) -> int:
    from router.cli import run_router
    if args.no_tokenizer:
        if args.model:
            raise SystemExit("kimi-pd router: give --model or --no-tokenizer, not both")
        return run_router(args, None)
    return run_router(args, str(_ensure_model(args.model)))


def _up(args: argparse.Namespace) -> int:
    from kimi_pd.up import ENGINE_FLAGS, ROUTER_FLAGS, passed_argv, up
    from router.admission.tenants import Tenants
    if getattr(args, "passed_tenants", None):
        args.passed_tenants = str(Path(args.passed_tenants).resolve())
        Tenants(args.passed_tenants)                 # a bad tenants file is refused before anything starts
    model = str(_default_chat_model(args.model).resolve())
    extra = []
    if args.speculative_config:
        from engine.spec_decode.config import SpeculativeConfig
        SpeculativeConfig.parse(args.speculative_config)            # refuse a bad config before starting anything
        extra = ["--speculative-config", args.speculative_config]
    from shared.openai.surface import surface_argv
    surface = surface_argv(args)                              # the router and every worker take the same
    return up(model, args.port, args.prefill_workers, args.decode_workers, args.redis_url, Path(args.log_dir),
              [*passed_argv(args, ENGINE_FLAGS), *surface], extra, _autoscale(args),
              [*passed_argv(args, ROUTER_FLAGS), *surface, "--workers", str(args.router_workers)])


def _autoscale(args: argparse.Namespace):
    """The --autoscale settings, or None (refused before anything starts when the bounds are wrong)."""
    if not args.autoscale:
        return None
    from kimi_pd.planner.exporter import parse_bounds
    from kimi_pd.planner.pools import AutoscaleSettings
    prefill, decode = parse_bounds(args.prefill_bounds), parse_bounds(args.decode_bounds)
    if not (prefill.minimum <= args.prefill_workers <= prefill.maximum
            and decode.minimum <= args.decode_workers <= decode.maximum):
        raise ValueError("--prefill-workers/--decode-workers must lie within --prefill-bounds/--decode-bounds")
    return AutoscaleSettings(prefill, decode, interval_s=args.autoscale_interval_s,
                             down_window_s=args.scale_down_window_s, down_step_s=args.scale_down_step_s)


def _bench(args: argparse.Namespace) -> int:
    from kimi_pd.bench.cli import run_bench
    return run_bench(args)


# what add_subparsers() returns (argparse keeps the class private); a string, so nothing subscripts it at run time
_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; one `_add_*` function per sub-command keeps each one's flags in one screen."""
    parser = argparse.ArgumentParser(prog="kimi-pd", description="Disaggregated prefill/decode serving for Kimi-K3.",
                                     allow_abbrev=False)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    ckpt = sub.add_parser("checkpoint", help="generated checkpoints", allow_abbrev=False)
    actions = ckpt.add_subparsers(dest="action", required=True)
    for add_action in (_add_create, _add_train_draft, _add_train, _add_eval, _add_quantize):
        add_action(actions)
    for add_command in (_add_generate, _add_router, _add_up, _add_bench, _add_plan, _add_signal,
                        _add_workers):
        add_command(sub)
    return parser


def _add_create(ckpt: _Subparsers) -> None:
    create = ckpt.add_parser("create", help="write a generated Kimi-K3 checkpoint (HF layout)", allow_abbrev=False)
    create.add_argument("--preset", choices=("tiny", "small", "tiny-chat", "tiny-chat-dspark", "tiny-chat-dspark-gqa"),
                        default="tiny", help="tiny/small: random weights; tiny-chat: copy the shipped trained "
                        "checkpoint; tiny-chat-dspark(-gqa): copy the shipped MLA (GQA) DSpark draft for tiny-chat")
    create.add_argument("--quant", choices=("w4a8",), default=None)
    create.add_argument("--seed", type=int, default=0)
    create.add_argument("--out", required=True)
    create.add_argument("--quiet", action="store_true", help="no progress bar")
    create.add_argument("--draft", action="store_true", help="a random DSpark draft (k3_dspark layout) for --target")
    create.add_argument("--target", help="with --draft: the target checkpoint directory")
    create.add_argument("--block", type=int, choices=(7, 5), default=None,
                        help="with --draft: Block7 or Block5 draft (its num_speculative_tokens default)")
    create.add_argument("--attention", choices=("mla", "gqa"), default="mla",
                        help="with --draft: k3_dspark MLA layout or the Qwen3-style GQA one")
    create.set_defaults(func=_checkpoint_create)


def _add_train_draft(ckpt: _Subparsers) -> None:
    distil = ckpt.add_parser("train-draft", help="distil a DSpark draft from a target's own features and greedy "
                                                 "answers", allow_abbrev=False)
    distil.add_argument("--target", required=True, help="the target checkpoint directory")
    distil.add_argument("--out", default=None, help="draft directory (default: TARGET-dspark)")
    distil.add_argument("--block", type=int, choices=(7, 5), default=7)
    distil.add_argument("--attention", choices=("mla", "gqa"), default="mla",
                        help="the draft's attention: k3_dspark MLA or the Qwen3-style GQA layout")
    distil.add_argument("--steps", type=int, default=1000)
    distil.add_argument("--sequences", type=int, default=384, help="prompts the target answers for the data")
    distil.add_argument("--seed", type=int, default=0)
    distil.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    distil.add_argument("--quiet", action="store_true")
    distil.set_defaults(func=_checkpoint_train_draft)


def _add_train(ckpt: _Subparsers) -> None:
    trn = ckpt.add_parser("train", help="train the tiny-chat model on the synthetic chat corpus (CPU)",
                          allow_abbrev=False)
    trn.add_argument("--out", required=True)
    trn.add_argument("--seed", type=int, default=0)
    trn.add_argument("--steps", type=int, default=TRAIN_STEPS)
    trn.add_argument("--workers", type=int, default=TRAIN_WORKERS,
                     help="data-parallel processes, one per core (gradients averaged every step)")
    trn.add_argument("--quiet", action="store_true", help="no progress bar")
    trn.set_defaults(func=_checkpoint_train)


def _add_eval(ckpt: _Subparsers) -> None:
    ev = ckpt.add_parser("eval", help="accuracy per task family on held-out instances (offline or via --url)",
                         allow_abbrev=False)
    ev.add_argument("--model", help="checkpoint directory (default: the shipped tiny-chat)")
    ev.add_argument("--url", help="score a running router instead (e.g. http://127.0.0.1:8000)")
    ev.add_argument("--n", type=int, default=50, help="held-out instances per family and thinking mode")
    ev.add_argument("--family", action="append", choices=FAMILY_NAMES, help="only this family (repeatable)")
    ev.add_argument("--thinking", choices=("on", "off", "both"), default="both")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=_checkpoint_eval)


def _add_quantize(ckpt: _Subparsers) -> None:
    quant = ckpt.add_parser("quantize", help="bf16/fp32 checkpoint -> ModelSlim W4A8 checkpoint", allow_abbrev=False)
    quant.add_argument("--src", required=True)
    quant.add_argument("--out", required=True)
    quant.add_argument("--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=_checkpoint_quantize)


def _add_generate(sub: _Subparsers) -> None:
    gen = sub.add_parser("generate", help="offline generation from one prompt", allow_abbrev=False)
    gen.add_argument("--model", help=f"checkpoint directory (default: {DEFAULT_TINY_DIR}, created if absent)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=_DTYPES, default="float32")
    gen.add_argument("--thinking", action="store_true", help="open a think block in the generation prompt")
    gen.add_argument("--json", action="store_true", help="print token ids and per-token logprobs as JSON")
    gen.set_defaults(func=_generate)


def _add_router(sub: _Subparsers) -> None:
    from router.cli import add_router_args
    router = sub.add_parser("router", help="the OpenAI-compatible gateway in front of the P/D fleet",
                            allow_abbrev=False)
    add_router_args(router)
    router.set_defaults(func=_router)


def _add_up(sub: _Subparsers) -> None:
    upp = sub.add_parser("up", help="router + prefill + decode workers on loopback, embedded defaults",
                         allow_abbrev=False)
    upp.add_argument("--model", help="checkpoint directory (default: the shipped trained tiny-chat)")
    upp.add_argument("--port", type=int, default=8000)
    upp.add_argument("--prefill-workers", type=int, default=1)
    upp.add_argument("--decode-workers", type=int, default=1)
    upp.add_argument("--router-workers", type=int, default=1, metavar="N",
                     help="router processes (the router's --workers); 1 by default: on one host the engine "
                          "workers need the cores more than the router does")
    upp.add_argument("--redis-url", default=None, help="use this store instead of starting an embedded one")
    upp.add_argument("--log-dir", default="logs")
    upp.add_argument("--speculative-config", default=None,
                     help="DSpark JSON (see the worker flag); decode workers speculate, prefill workers "
                          "write the draft's prompt context rows into the state they hand over")
    upp.add_argument("--autoscale", action="store_true",
                     help="pools follow the load within --prefill-bounds/--decode-bounds (docs/planner.md)")
    upp.add_argument("--prefill-bounds", default="1:4", help="MIN:MAX prefill workers under --autoscale")
    upp.add_argument("--decode-bounds", default="1:4", help="MIN:MAX decode workers under --autoscale")
    upp.add_argument("--autoscale-interval-s", type=float, default=2.0)
    upp.add_argument("--scale-down-window-s", type=float, default=30.0,
                     help="scale in only below the highest count asked for in this window")
    upp.add_argument("--scale-down-step-s", type=float, default=15.0, help="at most one worker retired per this")
    from kimi_pd.up import add_passed_args
    add_passed_args(upp)                 # the workers' engine flags and the router's admission flags, passed on
    from shared.openai.surface import add_surface_args
    add_surface_args(upp)                # the request-surface flags, passed on to the router and every worker
    upp.set_defaults(func=_up)


def _add_bench(sub: _Subparsers) -> None:
    from kimi_pd.bench.cli import add_bench_args
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint (vllm bench serve semantics)",
                           allow_abbrev=False)
    add_bench_args(bench)
    bench.set_defaults(func=_bench)


def _plan(args: argparse.Namespace) -> int:
    from kimi_pd.planner.cli import run_plan
    return run_plan(args)


def _add_plan(sub: _Subparsers) -> None:
    from kimi_pd.planner.cli import add_plan_args
    plan = sub.add_parser("plan", help="size the prefill and decode pools for a workload and SLO (simulated)",
                          allow_abbrev=False)
    add_plan_args(plan)
    plan.set_defaults(func=_plan)


def _signal(args: argparse.Namespace) -> int:
    from kimi_pd.planner.exporter import run_signal
    return run_signal(args)


def _add_signal(sub: _Subparsers) -> None:
    from kimi_pd.planner.exporter import add_signal_args
    sig = sub.add_parser("autoscale-signal", help="desired pool sizes from the store's load, as Prometheus "
                         "metrics for an HPA or KEDA", allow_abbrev=False)
    add_signal_args(sig)
    sig.set_defaults(func=_signal)


def _add_workers(sub: _Subparsers) -> None:
    from worker.flags import add_worker_args
    for role, help_text in (("prefill", "a prefill worker (computes prompts, hands state to decode workers)"),
                            ("decode", "a decode worker (pulls prefill state, generates, streams)"),
                            ("worker", "a colocated worker (prefill and decode in one engine)"),
                            ("serve", "`vllm serve MODEL_PATH ...` as written: a colocated worker with vLLM's "
                                      "defaults (docs/deployment.md)")):
        worker = sub.add_parser(role, help=help_text, allow_abbrev=False)
        add_worker_args(worker, serve=role == "serve")
        worker.set_defaults(func=_worker(role))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kimi-pd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
