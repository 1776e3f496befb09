"""`kimi-pd bench` flags -> a run. `vllm bench serve`'s command line is accepted as written: the same flag
names, defaults and meanings (`--base-url` or `--host`/`--port`, `--backend`, `--endpoint`, `--tokenizer-mode`,
the sampling flags, `--extra-body`, `--header`, `--num-warmups`, ...); flags of its that change nothing here
(`--trust-remote-code`, a Kimi `--tokenizer-mode`) are accepted and said so. Added: Mooncake replay, the
prefix-cache figures, plots, `--url` (the older name of `--base-url`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import uuid
from pathlib import Path

import httpx

from kimi_pd.bench import metrics as m
from kimi_pd.bench.client import CHAT, COMPLETIONS, RequestSettings
from kimi_pd.bench.datasets import MOONCAKE_BLOCK_TOKENS, sample_mooncake, sample_random, sample_sharegpt
from kimi_pd.bench.runner import RunSettings, print_summary, result_json, result_stem, run_benchmark, save
from kimi_pd.bench.tokenizer import TokenPool, load_tokenizer

BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT}   # vLLM's names -> the API spoken
DEFAULT_ENDPOINTS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
API_KEY_ENV = "OPENAI_API_KEY"             # sent as the bearer token, as vllm bench does
# every mode that loads this checkpoint's own (tiktoken) tokenizer files; vLLM's others need other tokenizers
TOKENIZER_MODES = ("auto", "hf", "slow", "kimi_k3", "kimi")
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "temperature", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    _add_target_args(p)
    _add_dataset_args(p)
    _add_load_args(p)
    _add_sampling_args(p)
    _add_output_args(p)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", "--url", dest="base_url", default=None,
                   help="server base URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=tuple(BACKENDS), default="openai",
                   help="openai, vllm: /v1/completions with the prompt text; openai-chat: one user message")
    p.add_argument("--endpoint", default=None, help="path (default: /v1/completions, /v1/chat/completions for chat)")
    p.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE", help="extra HTTP headers")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--served-model-name", default=None, help="the name sent in requests (default: --model)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint/tokenizer directory used to build prompts (default: --model if it is a directory)")
    p.add_argument("--tokenizer-mode", default="auto", help=f"one of {', '.join(TOKENIZER_MODES)}: each loads the "
                   "directory's Kimi tokenizer")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted; the Kimi tokenizer runs no remote code")
    p.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    p.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="retry the initial test request for up to this long while the server starts")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=("random", "sharegpt", "mooncake"), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake JSONL file")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="sets --random-output-len and --sharegpt-output-len")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every random prompt")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--mooncake-block-size", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per trace hash id; < 512 scales the trace's lengths down")
    p.add_argument("--mooncake-slowdown", type=float, default=1.0, help="multiply the trace's timestamps")
    p.add_argument("--mooncake-output-len", type=int, default=None, help="override the trace's output lengths")
    p.add_argument("--seed", type=int, default=0)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) before the run")
    p.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                   help="x-request-id of each request: this prefix and its index")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--skip-initial-test", action="store_true")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling parameters (sent only when given: the server's defaults apply)")
    for name in SAMPLING_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=int if name == "top_k" else float, default=None)
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="always on for the random dataset, as in vLLM")
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentile-metrics", default=",".join(m.METRICS))
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    p.add_argument("--append-result", action="store_true", help="append to the result file (one JSON per line)")
    p.add_argument("--result-dir", default=None, help="default: the current directory")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--no-plots", action="store_true", help="do not write PNGs next to the saved JSON")
    p.add_argument("--label", default=None)
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")


def _served_model(url: str, headers: dict[str, str], verify: bool) -> str:
    try:
        data = httpx.get(url + "/v1/models", headers=headers, timeout=30, verify=verify).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot read the model name from {url}/v1/models ({exc}); give --model") from exc


def _pairs(items: list[str], flag: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} takes KEY=VALUE, not {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _apply_vllm_defaults(args: argparse.Namespace) -> None:
    """vLLM's mappings: --input-len/--output-len set the dataset lengths; a random dataset ignores EOS so
    each request generates its requested length."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    if args.dataset_name == "random":
        args.ignore_eos = True
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode!r}: this client loads the checkpoint's Kimi "
                         f"tokenizer; use one of {', '.join(TOKENIZER_MODES)}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")


def _request_settings(args: argparse.Namespace) -> tuple[RequestSettings, str, str]:
    """The request every send makes, the model id and the tokenizer directory."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = os.environ.get(API_KEY_ENV) or None
    headers = _pairs(args.header or [], "--header")
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model_id = args.model or _served_model(base, {**dict(headers), **auth}, not args.insecure)
    tokenizer_dir = args.tokenizer or (model_id if Path(model_id).is_dir() else None)
    if tokenizer_dir is None:
        raise ValueError("give --tokenizer DIR (the served model's checkpoint or tokenizer directory)")
    backend = BACKENDS[args.backend]
    sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if k != "temperature" and getattr(args, k) is not None}
    request = RequestSettings(url=base + (args.endpoint or DEFAULT_ENDPOINTS[backend]), backend=backend,
                              model=args.served_model_name or model_id, ignore_eos=args.ignore_eos,
                              temperature=args.temperature, api_key=api_key, logprobs=args.logprobs,
                              extra_body=tuple({**sampling, **(args.extra_body or {})}.items()), headers=headers,
                              request_id_prefix=args.request_id_prefix)
    return request, model_id, str(tokenizer_dir)


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


def _percentiles(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    selected = tuple(x.strip() for x in args.percentile_metrics.split(",") if x.strip())
    if unknown := set(selected) - set(m.METRICS):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)} (choose from {', '.join(m.METRICS)})")
    try:
        percentiles = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles: not numbers: {args.metric_percentiles!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be within [0, 100]")
    return selected, percentiles


def run_bench(args: argparse.Namespace) -> int:
    _apply_vllm_defaults(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    selected, percentiles = _percentiles(args)
    request, model, tokenizer_dir = _request_settings(args)
    requests = sample(args, TokenPool.of(load_tokenizer(tokenizer_dir)))
    settings = RunSettings(request=request, request_rate=args.request_rate, burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, seed=args.seed, percentiles=percentiles,
                           selected_metrics=selected, goodput=tuple(m.parse_goodput(args.goodput).items()),
                           initial_test=not args.skip_initial_test, disable_tqdm=args.disable_tqdm,
                           request_timeout_s=args.request_timeout, metadata=_pairs(args.metadata, "--metadata"),
                           num_warmups=args.num_warmups, ready_check_s=float(args.ready_check_timeout_sec),
                           verify_tls=not args.insecure)
    if request.temperature is None:
        print("temperature: not sent, the server's default applies (as vllm bench serve; --temperature 0 for "
              "greedy)", file=sys.stderr)
    print(f"{len(requests)} {args.dataset_name} requests -> {request.url} (model {request.model}, rate "
          f"{args.request_rate}, max concurrency {args.max_concurrency})", file=sys.stderr)
    try:
        result = run_benchmark(requests, settings)
    except RuntimeError as exc:                 # the initial test request failed
        raise ValueError(str(exc)) from exc
    print_summary(result, settings)
    if args.save_result:
        out = result_json(result, settings, label=args.label, model_id=model, tokenizer_id=tokenizer_dir,
                          num_prompts=len(requests), dataset=args.dataset_name, detailed=args.save_detailed)
        stem = result_stem(settings, model, Path(args.result_dir or "."), args.result_filename)
        print(f"result: {save(out, stem, append=args.append_result)}")
        if not args.no_plots:
            from kimi_pd.bench.plots import write_plots
            for path in write_plots(out, result["detail"], stem):
                print(f"plot: {path}")
    return 0 if result["failed"] == 0 else 1
