"""DSpark speculative decoding: acceptance and wall-clock decode speedup, against plain decoding in the same run.

Run: `python -m benchmarks.spec_decode --target DIR --draft DIR [--k 7] [--batch-sizes 1 8]`.
Writes benchmarks/results/spec_decode.json:
- acceptance on the target's task-family prompts (its training families when `engine.training` is
  present; held-out instances): mean acceptance length = tokens emitted per target verification step
  (1 + accepted drafts, vLLM's "mean acceptance length"), mean accepted drafts per step, acceptance
  rate, per-position rates, per family;
- decode speedup at each batch size: the same greedy requests (task prompts, answers ending at eos)
  through a plain engine and a speculating one, timed per engine step after the prefill step (output
  tokens / decode seconds); the outputs are checked identical, so the speedup never buys a different answer.
Threads default to 1: on this 2-core shared machine intra-op threads cost more than they give at
these sizes, and both engines run with the same setting.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def family_prompts(llm: LLM, per_family: int, seed: int) -> dict[str, list[list[int]]]:
    """Held-out task-family prompts when the training package is there, else corpus-line prompts."""
    try:
        from engine.training.corpus import render_example
        from engine.training.tasks import FAMILIES, eval_instances
    except ImportError:
        from engine.spec_decode.train import training_prompts
        return {"corpus": training_prompts(llm.tokenizer, per_family, seed + 1)}
    rng = random.Random(seed)
    out = {}
    for family in FAMILIES:
        prompts = []
        for inst in eval_instances(family, per_family, seed=seed):
            ex = render_example(llm.tokenizer, inst, thinking=rng.random() < 0.5)
            prompts.append(ex.token_ids[: ex.num_prompt_tokens])
        out[family] = prompts
    return out


def acceptance(target: str, draft: str, k: int, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    result = {}
    total = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos = [0] * k
    for family, ps in prompts.items():
        llm = LLM(target, max_num_seqs=16, enable_prefix_caching=False, cache_memory_bytes=256 << 20,
                  speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": k})
        llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        s = llm.engine.spec_stats
        result[family] = {"mean_acceptance_length": round(s.mean_acceptance_length, 3),
                          "acceptance_rate": round(s.num_accepted_tokens / max(1, s.num_draft_tokens), 3),
                          "drafts": s.num_drafts}
        total["drafts"] += s.num_drafts
        total["draft_tokens"] += s.num_draft_tokens
        total["accepted"] += s.num_accepted_tokens
        per_pos = [a + b for a, b in zip(per_pos, s.accepted_per_pos, strict=False)]
    d = max(1, total["drafts"])
    return {"mean_acceptance_length": round(1 + total["accepted"] / d, 3),
            "mean_accepted_drafts_per_step": round(total["accepted"] / d, 3),
            "acceptance_rate": round(total["accepted"] / max(1, total["draft_tokens"]), 3),
            "per_position_rate": [round(p / d, 3) for p in per_pos], "num_drafts": total["drafts"],
            "per_family": result}


def timed_decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Run the batch to completion; seconds and tokens of every step after the first (the prefill)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)      # real answers: they end at eos
    ids = [engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {}
    first = True
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        new = sum(len(o.new_token_ids) for o in outs)
        if not first:
            decode_s += elapsed
            decode_tokens += new
        first = False
        for o in outs:
            if o.finished:
                outputs[o.request_id] = o.output.token_ids
    return [outputs[i] for i in ids], decode_s, decode_tokens


def speedup(target: str, draft: str, k: int, prompts: list[list[int]], batch: int, max_tokens: int,
            num_prompts: int) -> dict:
    """Groups of `batch` prompts, each group through the plain then the speculating engine (interleaved,
    so machine-load drift hits both alike); tokens and decode seconds summed over the groups."""
    common = dict(max_num_seqs=max(batch, 1), enable_prefix_caching=False, cache_memory_bytes=256 << 20)
    plain = LLM(target, **common)
    spec = LLM(target, **common, speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": k})
    chosen = [prompts[i % len(prompts)] for i in range(max(num_prompts, batch))]
    timed_decode(plain, chosen[:batch], 8)                      # warm-up both
    timed_decode(spec, chosen[:batch], 8)
    totals = {"plain_s": 0.0, "plain_tok": 0, "spec_s": 0.0, "spec_tok": 0}
    for start in range(0, len(chosen) - batch + 1, batch):
        group = chosen[start: start + batch]
        base_out, base_s, base_tok = timed_decode(plain, group, max_tokens)
        spec_out, spec_s, spec_tok = timed_decode(spec, group, max_tokens)
        assert base_out == spec_out, "speculative greedy output differs from plain greedy output"
        totals["plain_s"] += base_s
        totals["plain_tok"] += base_tok
        totals["spec_s"] += spec_s
        totals["spec_tok"] += spec_tok
    s = spec.engine.spec_stats
    plain_rate, spec_rate = totals["plain_tok"] / totals["plain_s"], totals["spec_tok"] / totals["spec_s"]
    return {"batch": batch, "requests": len(chosen) // batch * batch, "plain_tok_s": round(plain_rate, 1),
            "spec_tok_s": round(spec_rate, 1), "speedup": round(spec_rate / plain_rate, 3),
            "mean_acceptance_length": round(s.mean_acceptance_length, 3), "output_tokens": totals["spec_tok"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--per-family", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--speed-prompts", type=int, default=16, help="requests per batch size for the speedup")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probe = LLM(args.target, max_num_seqs=1)
    prompts = family_prompts(probe, args.per_family, args.seed)
    flat = [p for ps in prompts.values() for p in ps]
    result = {"target": args.target, "draft": args.draft, "k": args.k, "threads": args.threads,
              "acceptance": acceptance(args.target, args.draft, args.k, prompts, args.max_tokens),
              "speedup": [speedup(args.target, args.draft, args.k, random.Random(args.seed).sample(flat, len(flat)), b,
                                  args.max_tokens, args.speed_prompts) for b in args.batch_sizes]}
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
