"""benchmarks/render_cost.py: its workloads are valid chats of the shapes it names, each tree is timed in a
child of its own, and the table reads the JSON."""
from __future__ import annotations

from benchmarks import render_cost
from benchmarks.paired_trees import alternate, medians, paired_ratio
from benchmarks.placement_cost import ROOT
from shared.openai.prompts import prepare_chat
from shared.openai.requests import ChatCompletionRequest
from shared.prompt.tokenizer import KimiTokenizer


def test_each_workload_prepares_and_differs_only_in_its_last_turn():
    tokenizer = KimiTokenizer.generated()
    sizes = {"chat-1": 1, "chat-40": 40, "tools-10": 10}
    for workload in render_cost.WORKLOADS:
        reqs = [ChatCompletionRequest.model_validate(b) for b in render_cost.bodies(workload, count=3)]
        assert all(len(r.messages) == sizes[workload] for r in reqs)
        ids = [prepare_chat(r, tokenizer, None).token_ids for r in reqs]
        assert len({tuple(i) for i in ids}) == 3                       # each request its own prompt
        shared = next(k for k in range(len(ids[0])) if ids[0][k] != ids[1][k])
        assert shared > len(ids[0]) // 2 if workload != "chat-1" else shared > 100   # a long common prefix


def test_each_tree_is_timed_in_its_own_child_and_the_table_reads_the_json(tmp_path):
    runs = alternate({"ours": ROOT, "baseline": ROOT}, ROOT / "benchmarks" / "render_cost.py",
                     ["chat-1 0.02", "tools-10 0.02"], slices=2)
    runs = {name: {r.split()[0]: cells for r, cells in per.items()} for name, per in runs.items()}
    doc = {"runs": runs, "median": medians(runs), "paired_ratio": paired_ratio(runs, "ours", "baseline", "prepare_us")}
    assert all(len(runs[n][w]) == 2 and doc["median"][n][w]["prepare_us"] > 0 for n in runs for w in runs[n])
    lines = render_cost.table(doc).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| chat-1 | ") and lines[3].endswith("x |")
    out = tmp_path / "rc.json"
    assert render_cost.main(["--workloads", "chat-1", "--slices", "1", "--seconds", "0.02", "--output", str(out)]) == 0
    assert out.is_file() and "| chat-1 |" in out.with_suffix(".md").read_text()
