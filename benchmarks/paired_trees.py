"""A same-run A/B of two checkouts for CPU-bound microbenchmarks: one measuring child per tree, slices taken
in turns.

Why: on the shared 2-core host the same slice varied up to 1.7x between runs a few seconds apart, which a
few long rounds per tree did not average out. So each tree gets a child process of its own (its modules
first on the path, as `benchmarks.services.checkout_path` gives), kept for the whole run, and the trees
take turns in short slices with the order flipped every slice: a noisy neighbour's bursts land on both,
and the ratio of each pair of slices (taken within a second of each other) is what a comparison reads.

A benchmark module using this runs its own file with `--child` in each tree: the child reads one request
per line on stdin and answers one line of JSON, importing nothing of benchmarks/ (an older tree may lack
this module). Used by placement_cost and render_cost.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class Child:
    """One tree's measuring process: `python <script> --child`, run from the tree with its modules first."""

    def __init__(self, tree: Path, script: Path) -> None:
        from benchmarks.services import checkout_path
        env = {**os.environ, "PYTHONPATH": checkout_path(tree, os.environ.get("PYTHONPATH", ""))}
        self.tree = tree
        # a file, not a pipe: a chatty child never blocks on it; closed in close()
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, str(script), "--child"], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True)

    def ask(self, request: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.errors.seek(0)
            raise RuntimeError(f"the measuring child for {self.tree} failed:\n{self.errors.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()                          # closes its pipes
        self.errors.close()


def alternate(trees: dict[str, Path], script: Path, requests: list[str], slices: int
              ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """tree -> request -> `slices` answers, the trees taking turns slice by slice (order flipped every slice)."""
    children: dict[str, Child] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {r: [] for r in requests} for name in trees}
    try:
        for name, tree in trees.items():
            children[name] = Child(tree, script)
        for request in requests:
            for k in range(slices):
                for name in (list(trees) if k % 2 == 0 else list(reversed(trees))):
                    runs[name][request].append(children[name].ask(request))
    finally:
        for c in children.values():
            c.close()
    return runs


def medians(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    return {name: {request: {key: statistics.median(cell[key] for cell in cells) for key in cells[0]}
                   for request, cells in per_request.items()} for name, per_request in runs.items()}


def paired_ratio(runs: dict[str, dict[str, list[dict[str, float]]]], ours: str, base: str, key: str
                 ) -> dict[str, float]:
    """Per request, the median over slices of ours / base for `key` (each pair ran back to back)."""
    return {request: statistics.median(a[key] / b[key] for a, b in zip(cells, runs[base][request], strict=True))
            for request, cells in runs[ours].items()}


def commit_of(tree: Path) -> str | None:
    """The checkout's commit (and `+changes` when its tree differs from it), or None outside git."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def result_doc(argv: list[str], trees: dict[str, Path], **config: Any) -> dict[str, Any]:
    """The start of a result: the command's arguments, when, each tree's commit, the load average, the host."""
    return {"argv": argv, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commits": {name: commit_of(tree) for name, tree in trees.items()},
            "loadavg_start": list(os.getloadavg()), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            **config, "trees": {k: str(v) for k, v in trees.items()}}


def write_result(doc: dict[str, Any], output: Path, title: str, module: str, table: str) -> None:
    """The load average at the end, the JSON at `output` and the table in a `.md` beside it."""
    doc["loadavg_end"] = list(os.getloadavg())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(doc, indent=1) + "\n")
    trees_line = ", ".join(f"{name} {doc['commits'][name] or doc['trees'][name]}" for name in doc["trees"])
    output.with_suffix(".md").write_text(
        f"# {title}\n\n`python -m {module} {' '.join(doc['argv'])}`, {doc['when']} ({trees_line}; "
        f"docs/router-performance.md reads it)\n\n{table}\n\nload average {doc['loadavg_start'][0]:.2f} -> "
        f"{doc['loadavg_end'][0]:.2f}, {doc['cpus']} cpus\n")


def table(doc: dict[str, Any], row_name: str, columns: dict[str, str], ratio_label: str) -> str:
    """Markdown: one row per request, each tree's median of each column (key -> label), then the paired ratio."""
    med, ratio = doc["median"], "paired_ratio" in doc
    names = list(med)
    head = f"| {row_name} | " + " | ".join(f"{n} {label}" for n in names for label in columns.values())
    lines = [head + (f" | {ratio_label}, ours / baseline (median of paired slices) |" if ratio else " |"),
             "|---" * (1 + len(columns) * len(names) + ratio) + "|"]
    for row in med[names[0]]:
        cells = [f"{med[n][row][key]:.1f}" for n in names for key in columns]
        extra = f" | {doc['paired_ratio'][row]:.2f}x" if ratio else ""
        lines.append(f"| {row} | " + " | ".join(cells) + extra + " |")
    return "\n".join(lines)
