"""What preparing a chat prompt costs the router (render + tokenise), with a same-run A/B against another checkout.

Run: `python -m benchmarks.render_cost [--slices 20] [--seconds 0.25] [--baseline-tree DIR]` (DIR: another
checkout, e.g. `git worktree add /tmp/base main`); about half a minute.

The router prepares every chat request it places: the OpenAI request's render options and messages, the
K3 chat render (tags, attributes and text, each piece encoded on its own, with the piece and segment
memos warm) and the token ids (`shared.openai.prompts.prepare_chat`, as `router.prompt_source` calls it).
benchmarks/router_overhead.py `--stages` puts that stage at about a fifth of the router's CPU per request
for a one-message chat; agents resend whole histories, where the per-message framing adds up. Workloads:

- `chat-1`: one user message of ~1,000 characters with a per-request tail (router_overhead's prompt);
- `chat-40`: 20 user and 20 assistant turns of one sentence each, resent whole (a new last turn each time);
- `tools-10`: a system prompt, two declared tools, assistant tool calls and their results, 10 messages.

Each tree is timed in a child of its own, the trees taking turns slice by slice (benchmarks/paired_trees.py).
The tokenizer is the generated K3 one (`KimiTokenizer.generated()`, the tests' tokenizer: the same code
path as a checkpoint's, a smaller vocabulary). Writes benchmarks/results/render_cost.json and a table
beside it (benchmarks/results/render_cost.md), with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ("chat-1", "chat-40", "tools-10")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a city", "parameters": CITY}}
         for name in ("get_weather", "get_time")]


def bodies(workload: str, count: int = 64) -> list[dict[str, Any]]:
    """`count` request bodies of one workload, each differing from the others in its last turn."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every bold juror near "
             "the old mill ")
    out = []
    for i in range(count):
        if workload == "chat-1":
            messages: list[dict[str, Any]] = [{"role": "user", "content": words * 9 + f"(request {i})"}]
        elif workload == "chat-40":
            messages = []
            for turn in range(20):
                messages += [{"role": "user", "content": f"question {turn}: what about the weather in city {turn}?"},
                             {"role": "assistant", "content": f"answer {turn}: sunny in city {turn}, {20 + turn} C."}]
            messages[-2]["content"] += f" (request {i})"
        else:
            messages = [{"role": "system", "content": "You answer with tools when you can."}]
            for turn in range(3):
                messages += [{"role": "user", "content": f"weather and time in city {turn}?"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": f"c{turn}{k}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps({"city": f"city {turn}"})}}
                                 for k, name in enumerate(("get_weather", "get_time"))]},
                             {"role": "tool", "tool_call_id": f"c{turn}1", "content": "noon"}]
            messages[-3]["content"] += f" (request {i})"
        body: dict[str, Any] = {"model": "kimi-k3", "messages": messages}
        if workload == "tools-10":
            body["tools"] = TOOLS
        out.append(body)
    return out


def child() -> None:
    """In the tree on the path, until stdin closes: for each line `<workload> <seconds>`, one line of JSON
    with the µs per prepared chat. Imports only the tree's shared/ modules, so an older checkout is
    measured the same way."""
    from shared.openai.prompts import prepare_chat
    from shared.openai.requests import ChatCompletionRequest
    from shared.prompt.tokenizer import KimiTokenizer
    tokenizer = KimiTokenizer.generated()
    requests = {w: [ChatCompletionRequest.model_validate(b) for b in bodies(w)] for w in WORKLOADS}
    for line in sys.stdin:
        workload, seconds = line.split()[0], float(line.split()[1])
        reqs, state = requests[workload], {"i": 0}

        def prepare(reqs: list[Any] = reqs, state: dict[str, int] = state) -> None:
            state["i"] += 1
            prepare_chat(reqs[state["i"] % len(reqs)], tokenizer, None)

        for _ in range(2 * len(reqs)):                   # warm: both memos, the code paths
            prepare()
        timer = timeit.Timer(prepare)
        number = max(1, int(timer.autorange()[0] * seconds / 0.2))
        print(json.dumps({"prepare_us": timer.timeit(number) / number * 1e6}), flush=True)


def table(doc: dict[str, Any]) -> str:
    from benchmarks.paired_trees import table as paired_table
    return paired_table(doc, "workload", {"prepare_us": "µs per prepared chat"}, "µs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slices", type=int, default=20, help="timings per workload and tree, the trees taking turns")
    p.add_argument("--seconds", type=float, default=0.25, help="length of one slice")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--baseline-tree", type=Path, help="another checkout, timed beside this one")
    p.add_argument("--output", type=Path, default=RESULTS / "render_cost.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child()
        return 0
    if args.slices < 1 or args.seconds <= 0:
        p.error("--slices must be >= 1 and --seconds > 0")
    from benchmarks.paired_trees import alternate, medians, paired_ratio, result_doc, write_result
    trees = {"ours": ROOT} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    doc = result_doc(sys.argv[1:] if argv is None else argv, trees, slices=args.slices, seconds=args.seconds)
    runs = alternate(trees, Path(__file__).resolve(), [f"{w} {args.seconds}" for w in args.workloads], args.slices)
    runs = {name: {request.split()[0]: cells for request, cells in per.items()} for name, per in runs.items()}
    doc |= {"runs": runs, "median": medians(runs)}
    if len(trees) == 2:
        doc["paired_ratio"] = paired_ratio(runs, "ours", "baseline", "prepare_us")
    text = table(doc)
    write_result(doc, args.output, "Chat prepare cost per request", "benchmarks.render_cost", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
