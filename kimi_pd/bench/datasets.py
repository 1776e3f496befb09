"""Benchmark workloads: random prompts, a ShareGPT-style JSON file, Mooncake trace replay.

Every sampler returns `SampleRequest`s whose prompt text encodes to exactly `prompt_len` tokens
of the given tokenizer (random and Mooncake prompts are built from `TokenPool` tokens; ShareGPT
prompts are counted). Sampling is seeded and isolated (its own numpy Generator).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_pd.bench.tokenizer import TokenPool

MOONCAKE_BLOCK_TOKENS = 512        # the traces' hash_ids cover 512-token prefix blocks


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str
    arrival_s: float | None = None          # trace replay: seconds after the start (else the rate decides)


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float, low_bound: int) -> np.ndarray:
    """vLLM's range ratio: integers uniform in [mean * (1 - r), mean * (1 + r)]."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {ratio}")
    low, high = max(low_bound, math.floor(mean * (1 - ratio))), max(low_bound, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random(pool: TokenPool, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """`prefix_len` tokens shared by every prompt, then `input_len` (+- range) random tokens."""
    if input_len < 0 or prefix_len < 0 or input_len + prefix_len < 1:
        raise ValueError("--random-input-len + --random-prefix-len must be at least 1 token")
    if output_len < 1:
        raise ValueError("--random-output-len must be at least 1")
    rng = np.random.default_rng(seed)
    tokens = np.asarray(pool.ids)
    prefix = rng.choice(tokens, size=prefix_len).tolist()
    in_lens = _lengths(rng, num_requests, input_len, range_ratio, 0 if prefix_len else 1)
    out_lens = _lengths(rng, num_requests, output_len, range_ratio, 1)
    out = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=False)):
        ids = prefix + rng.choice(tokens, size=int(n_in)).tolist()
        out.append(SampleRequest(pool.text(ids), len(ids), int(n_out), f"random-{i}"))
    return out


def sample_sharegpt(pool: TokenPool, path: str | Path, num_requests: int, output_len: int | None = None,
                    seed: int = 0, max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """The first human turn as the prompt; the first reply's token count as the output length
    (unless `output_len`). Like vLLM: shuffled with the seed; pairs with < 4 tokens, prompts over
    `max_prompt_len` and prompt + output over `max_total_len` are skipped."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} objects")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    tok = pool.tokenizer
    out: list[SampleRequest] = []
    for j in order:
        prompt, reply = str(convs[j][0].get("value", "")), str(convs[j][1].get("value", ""))
        n_in = len(tok.encode(prompt))
        n_out = output_len if output_len is not None else len(tok.encode(reply))
        if n_in < 4 or (output_len is None and n_out < 4) or n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue
        out.append(SampleRequest(prompt, n_in, n_out, f"sharegpt-{len(out)}"))
        if len(out) == num_requests:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversation (need two turns with >= 4 tokens each)")
    return out


def mooncake_block(pool: TokenPool, hash_id: int, block_tokens: int, seed: int) -> list[int]:
    """The tokens a trace block stands for: a pure function of (seed, hash id), so equal hash ids
    (a shared system prompt, an earlier turn) give equal text, hence equal token prefixes."""
    rng = np.random.default_rng([seed, hash_id])
    return rng.choice(np.asarray(pool.ids), size=block_tokens).tolist()


def sample_mooncake(pool: TokenPool, path: str | Path, num_requests: int | None,
                    block_tokens: int = MOONCAKE_BLOCK_TOKENS, slowdown: float = 1.0,
                    output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """Replay a Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids).

    `block_tokens` < 512 scales the trace down (each block, hence each length, shrinks by
    block_tokens/512) so a small model can replay it; `slowdown` stretches the timestamps.
    """
    if block_tokens < 1 or slowdown <= 0:
        raise ValueError("--mooncake-block-size must be >= 1 and --mooncake-slowdown > 0")
    blocks: dict[int, list[int]] = {}
    out: list[SampleRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_requests is not None and len(out) == num_requests:
                break
            try:
                rec = json.loads(line)
                ts, n_in, n_out, hash_ids = (float(rec["timestamp"]), int(rec["input_length"]),
                                             int(rec["output_length"]), [int(h) for h in rec["hash_ids"]])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record: {exc}") from exc
            if not hash_ids or n_in < 1:
                raise ValueError(f"{path}:{line_no}: a record needs input_length >= 1 and hash_ids")
            scaled = round(n_in * block_tokens / MOONCAKE_BLOCK_TOKENS)
            length = min(len(hash_ids) * block_tokens, max((len(hash_ids) - 1) * block_tokens + 1, scaled))
            ids: list[int] = []
            for h in hash_ids:
                if h not in blocks:
                    blocks[h] = mooncake_block(pool, h, block_tokens, seed)
                ids.extend(blocks[h])
            ids = ids[:length]
            out.append(SampleRequest(pool.text(ids), length, max(1, output_len or n_out), f"mooncake-{len(out)}",
                                     arrival_s=ts / 1000.0 * slowdown))
    if not out:
        raise ValueError(f"{path}: no records")
    return out
