"""DSpark speculative decoding: plain vs fixed K vs adaptive K, decode tokens/s at several batch sizes, one run.

Run: `python -m benchmarks.spec_decode [--target DIR] [--draft DIR] [--k 7] [--batch-sizes 1 4 8 16]`
(defaults: the shipped tiny-chat and tiny-chat-dspark, 8 rounds; about 1 minute on 2 cores).
Writes benchmarks/results/spec_decode.json and .md:
- per batch size, decode tokens/s of three engines over the same greedy requests (task-family prompts,
  answers ending at eos), timed per engine step after the prefill step: plain, DSpark with a fixed K,
  and DSpark with the adaptive K (engine/spec_decode/adaptive.py). The engines decode each batch
  together, one step of each in turn (`interleaved_decode`), so the host's drifting speed hits all
  alike; the outputs are checked identical to plain, so a speedup never buys a different answer;
- acceptance of the fixed-K engine (mean acceptance length, per-position rates) and the adaptive
  engine's choices (steps by K, measured step costs);
- a projection of the speedup for Kimi-K3 itself from the measured acceptance (engine/spec_decode/projection.py);
- the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from benchmarks.spec_decode_report import projection, write_markdown
from engine import LLM, SamplingParams

TARGET, DRAFT = "engine/presets_data/tiny-chat", "engine/presets_data/tiny-chat-dspark"


def family_prompts(llm: LLM, per_family: int, seed: int) -> list[list[int]]:
    """Held-out task-family prompts when the training package is there, else corpus-line prompts."""
    try:
        from engine.training.corpus import render_example
        from engine.training.tasks import FAMILIES, eval_instances
    except ImportError:
        from engine.spec_decode.train import training_prompts
        return training_prompts(llm.tokenizer, per_family * 7, seed + 1)
    rng = random.Random(seed)
    out = []
    for family in FAMILIES:
        for inst in eval_instances(family, per_family, seed=seed):
            ex = render_example(llm.tokenizer, inst, thinking=rng.random() < 0.5)
            out.append(ex.token_ids[: ex.num_prompt_tokens])
    rng.shuffle(out)
    return out


def timed_decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Run the batch to completion on one engine; seconds and tokens of every step after the first (the prefill)."""
    outputs, decode_s, decode_tokens = interleaved_decode({"one": llm}, prompts, max_tokens)["one"]
    return outputs, decode_s, decode_tokens


def interleaved_decode(llms: dict[str, LLM], prompts: list[list[int]], max_tokens: int) \
        -> dict[str, tuple[list[list[int]], float, int]]:
    """Run the same batch on every engine, one step of each in turn until all are done; per engine the
    outputs and the seconds and tokens of its steps after the first (the prefill).

    Step by step, because this host's speed drifts in phases of seconds (the same engine on the same
    batch: 2.4 ms a step for a while, then 4.7-5.4 ms, then back): engines run one after another a
    whole batch at a time measured 0.65-1.97x each other when they were identical."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)      # real answers: they end at eos
    state = {}
    for name, llm in llms.items():
        ids = [llm.engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
        state[name] = {"ids": ids, "outputs": {}, "first": True, "seconds": 0.0, "tokens": 0}
    running = list(llms)
    while running:
        for name in list(running):
            engine, st = llms[name].engine, state[name]
            start = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - start
            if not st["first"]:
                st["seconds"] += elapsed
                st["tokens"] += sum(len(o.new_token_ids) for o in outs)
            st["first"] = False
            for o in outs:
                if o.finished:
                    st["outputs"][o.request_id] = o.output.token_ids
            if not engine.has_unfinished():
                running.remove(name)
    return {name: ([st["outputs"][i] for i in st["ids"]], st["seconds"], st["tokens"]) for name, st in state.items()}


def engines(args) -> dict[str, LLM]:
    common = dict(max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False, cache_memory_bytes=256 << 20)
    spec = {"method": "dspark", "model": args.draft, "num_speculative_tokens": args.k}
    return {"plain": LLM(args.target, **common),
            "fixed": LLM(args.target, **common, speculative_config={**spec, "adaptive_num_speculative_tokens": False}),
            "adaptive": LLM(args.target, **common,
                            speculative_config={**spec, "adaptive_num_speculative_tokens": True})}


def run(args, llms: dict[str, LLM], prompts: list[list[int]]) -> dict:
    totals = {(b, name): [0.0, 0] for b in args.batch_sizes for name in llms}
    per_round: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
    steps_by_k: dict[int, list[int]] = {}
    for llm in llms.values():                                   # warm-up, and the adaptive costs get measured
        timed_decode(llm, prompts[:2], 8)
    adaptive_stats = llms["adaptive"].engine.spec_stats
    for rnd in range(args.rounds):
        for b in args.batch_sizes:
            group = [prompts[(rnd * 97 + b * 13 + i) % len(prompts)] for i in range(b)]
            before = list(adaptive_stats.steps_by_k) if adaptive_stats else None
            results = interleaved_decode(llms, group, args.max_tokens)
            reference = results["plain"][0]
            for name, (out, secs, toks) in results.items():
                if out != reference:
                    raise AssertionError(f"{name} greedy output differs from plain at batch {b}")
                totals[(b, name)][0] += secs
                totals[(b, name)][1] += toks
            rates = {name: toks / secs for name, (_, secs, toks) in results.items()}
            per_round[b].append(rates["adaptive"] / rates["plain"])
            if adaptive_stats and before is not None:
                acc = steps_by_k.setdefault(b, [0] * len(before))
                steps_by_k[b] = [a + x - y for a, x, y in zip(acc, adaptive_stats.steps_by_k, before, strict=True)]
    rows = []
    for b in args.batch_sizes:
        rate = {name: totals[(b, name)][1] / totals[(b, name)][0] for name in llms}
        spread = sorted(per_round[b])
        rows.append({"batch": b, "requests": b * args.rounds, **{f"{n}_tok_s": round(r, 1) for n, r in rate.items()},
                     "fixed_speedup": round(rate["fixed"] / rate["plain"], 3),
                     "adaptive_speedup": round(rate["adaptive"] / rate["plain"], 3),
                     "adaptive_speedup_by_round": {"min": round(spread[0], 3),
                                                   "median": round(spread[len(spread) // 2], 3),
                                                   "max": round(spread[-1], 3)},
                     "adaptive_steps_by_k": steps_by_k.get(b)})
    return {"speedup": rows}


def acceptance(llm: LLM) -> dict:
    s = llm.engine.spec_stats
    d = max(1, s.num_drafts)
    return {"mean_acceptance_length": round(s.mean_acceptance_length, 3),
            "acceptance_rate": round(s.num_accepted_tokens / max(1, s.num_draft_tokens), 3),
            "per_position_rate": [round(p / d, 3) for p in s.accepted_per_pos], "num_drafts": s.num_drafts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--draft", default=DRAFT)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens (fixed K; the adaptive bound)")
    parser.add_argument("--per-family", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=8, help="groups of `batch` requests per batch size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start, started = os.getloadavg(), time.perf_counter()
    llms = engines(args)
    prompts = family_prompts(llms["plain"], args.per_family, args.seed)
    result = {"target": args.target, "draft": args.draft, "k": args.k, "threads": args.threads,
              "max_tokens": args.max_tokens, **run(args, llms, prompts)}
    result["acceptance"] = acceptance(llms["fixed"])
    result["adaptive_costs"] = llms["adaptive"].engine.speculation.costs().to_dict()
    result["k3_projection"] = projection(result["acceptance"]["per_position_rate"], args.k)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["loadavg_start"], result["loadavg_end"] = list(load_start), list(os.getloadavg())
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    write_markdown(result, Path(args.out).with_suffix(".md"))


if __name__ == "__main__":
    main()
