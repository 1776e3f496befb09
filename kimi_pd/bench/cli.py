"""`kimi-pd bench` flags (vllm bench serve's names where the meaning is the same) -> a run."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import httpx

from kimi_pd.bench import metrics as m
from kimi_pd.bench.client import CHAT, COMPLETIONS, RequestSettings
from kimi_pd.bench.datasets import MOONCAKE_BLOCK_TOKENS, sample_mooncake, sample_random, sample_sharegpt
from kimi_pd.bench.runner import RunSettings, print_summary, result_json, result_stem, run_benchmark, save
from kimi_pd.bench.tokenizer import TokenPool, load_tokenizer

DEFAULT_ENDPOINTS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
API_KEY_ENV = "OPENAI_API_KEY"             # sent as the bearer token, as vllm bench does


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", choices=(COMPLETIONS, CHAT), default=COMPLETIONS,
                   help="openai: /v1/completions with the prompt text; openai-chat: one user message")
    p.add_argument("--endpoint", default=None, help="path (default by backend)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint/tokenizer directory used to build prompts (default: --model if it is a directory)")
    p.add_argument("--dataset-name", choices=("random", "sharegpt", "mooncake"), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake JSONL file")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every random prompt")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--mooncake-block-size", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per trace hash id; < 512 scales the trace's lengths down")
    p.add_argument("--mooncake-slowdown", type=float, default=1.0, help="multiply the trace's timestamps")
    p.add_argument("--mooncake-output-len", type=int, default=None, help="override the trace's output lengths")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default=",".join(m.METRICS))
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--no-plots", action="store_true", help="do not write PNGs next to the saved JSON")
    p.add_argument("--label", default=None)
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--skip-initial-test", action="store_true")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0)


def _served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot read the model name from {url}/v1/models ({exc}); give --model") from exc


def _metadata(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, not {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def sample(args: argparse.Namespace, pool: TokenPool):
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset_name == "random":
        return sample_random(pool, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.random_prefix_len, args.seed)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(pool, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)
    return sample_mooncake(pool, args.dataset_path, args.num_prompts, args.mooncake_block_size,
                           args.mooncake_slowdown, args.mooncake_output_len, args.seed)


def run_bench(args: argparse.Namespace) -> int:
    api_key = os.environ.get(API_KEY_ENV) or None
    model = args.model or _served_model(args.url, api_key)
    tokenizer_dir = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if tokenizer_dir is None:
        raise ValueError("give --tokenizer DIR (the served model's checkpoint or tokenizer directory)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    selected = tuple(x.strip() for x in args.percentile_metrics.split(",") if x.strip())
    if unknown := set(selected) - set(m.METRICS):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)} (choose from {', '.join(m.METRICS)})")
    try:
        percentiles = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles: not numbers: {args.metric_percentiles!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be within [0, 100]")
    pool = TokenPool.of(load_tokenizer(tokenizer_dir))
    requests = sample(args, pool)
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    request = RequestSettings(url=args.url.rstrip("/") + endpoint, backend=args.backend, model=model,
                              ignore_eos=args.ignore_eos, temperature=args.temperature, api_key=api_key)
    settings = RunSettings(request=request, request_rate=args.request_rate, burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, seed=args.seed, percentiles=percentiles,
                           selected_metrics=selected, goodput=tuple(m.parse_goodput(args.goodput).items()),
                           initial_test=not args.skip_initial_test, disable_tqdm=args.disable_tqdm,
                           request_timeout_s=args.request_timeout, metadata=_metadata(args.metadata))
    print(f"{len(requests)} {args.dataset_name} requests -> {request.url} (model {model}, rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency})", file=sys.stderr)
    try:
        result = run_benchmark(requests, settings)
    except RuntimeError as exc:                 # the initial test request failed
        raise ValueError(str(exc)) from exc
    print_summary(result, settings)
    if args.save_result:
        out = result_json(result, settings, label=args.label, model_id=model, tokenizer_id=str(tokenizer_dir),
                          num_prompts=len(requests), dataset=args.dataset_name, detailed=args.save_detailed)
        stem = result_stem(settings, model, Path(args.result_dir), args.result_filename)
        print(f"result: {save(out, stem)}")
        if not args.no_plots:
            from kimi_pd.bench.plots import write_plots
            for path in write_plots(out, result["detail"], stem):
                print(f"plot: {path}")
    return 0 if result["failed"] == 0 else 1
