"""How fast each float32 product streams its weight at decode's row counts, one thread, weights out of cache.

Run: `python -m benchmarks.linear_rates [--shapes 2080x1024 768x512 ...] [--rows 1 2 3 4 8 16]` (about 2 minutes).
For every weight shape (default: the small preset's decode linears) it makes enough distinct weights to
overflow the last-level cache, then times one product per weight in turn, best of `--repeats` passes:
  - `rowdot`: the row-major kernel (engine/model/rowdot.py; the engine uses it for one row), any row count here;
  - `panels`: the panel kernel on its packed copy (the engine's choice for 2-16 rows);
  - `onednn_packed`: oneDNN's inner product on its blocked copy of the weight (the engine's choice above 16 rows);
  - `onednn`: oneDNN on the row-major weight; `aten`: `F.linear` (MKL);
  - `sum`: a streaming sum of the same weights, the read rate one thread gets, as the ceiling;
  - `panels_in_cache`: the panel kernel on ONE weight again and again (in cache after the first call): its
    arithmetic ceiling at that row count. Where it is below `sum`, more rows make the product compute-bound
    (8 float32 rows are 8 multiply-adds per weight element read), and no streaming trick helps.
Writes `benchmarks/results/linear_rates.json` (GB/s of weight read and us per call, the load average)
and prints a table; ratios are within this run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import engine  # noqa: F401  (its OpenMP defaults, for a run without torch loaded yet)
from benchmarks.services import cpu_model
from engine.model import rowdot
from engine.model.gemm import PACK_ROWS

# the small preset's decode linears: MoE input (fused) and output, routed experts' w1|w3 and w2, latent
# projections, MLA/KDA projections, the LM head
SMALL_PRESET_SHAPES = ["2080x1024", "2120x1024", "1024x768", "1024x512", "768x512", "512x384", "5632x1024"]
CACHE_BYTES = 256 << 20        # weights made per shape: at least this many bytes, far past any L3


def best_seconds(weights: list[Any], call: Callable[[Any], object], repeats: int) -> float:
    """Best mean seconds per call over `repeats` passes, each pass one call per weight in turn."""
    for w in weights:
        call(w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            call(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def products(x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor],
             kernel: rowdot.Kernel | None, panels: list[torch.Tensor]
             ) -> dict[str, tuple[list[torch.Tensor], Callable[[Any], object]]]:
    """name -> (the weights it runs on, one product of `x` with one of them)."""
    pointwise = torch.ops.mkldnn._linear_pointwise
    calls: dict[str, tuple[list[torch.Tensor], Callable[[Any], object]]] = {
        "onednn_packed": (packed, lambda w: pointwise(x, w, None, "none", [], "")),
        "onednn": (weights, lambda w: pointwise(x, w, None, "none", [], "")),
        "aten": (weights, lambda w: F.linear(x, w)),
    }
    if kernel is not None:
        calls["rowdot"] = (weights, lambda w: kernel(x, w))
        out = weights[0].shape[0]
        calls["panels"] = (panels, lambda p: kernel.panels(x, p, out))
        calls["panels_in_cache"] = (panels[:1] * len(panels), lambda p: kernel.panels(x, p, out))
    return calls


def measure(shape: tuple[int, int], rows_list: list[int], repeats: int) -> dict[str, Any]:
    out, n = shape
    nbytes = out * n * 4
    count = max(8, CACHE_BYTES // nbytes)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, n, generator=gen) for _ in range(count)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    kernel = rowdot.kernel()
    panels = [kernel.pack(w) for w in weights] if kernel is not None else []
    result: dict[str, Any] = {"shape": [out, n], "weights": count, "rows": {}}
    result["sum_gb_per_s"] = nbytes / best_seconds(weights, lambda w: w.sum(), repeats) / 1e9
    with torch.inference_mode():
        for rows in rows_list:
            cell = {}
            x = torch.randn(rows, n, generator=gen)
            for name, (ws, call) in products(x, weights, packed, kernel, panels).items():
                s = best_seconds(ws, call, repeats)
                cell[name] = {"us": s * 1e6, "gb_per_s": nbytes / s / 1e9}
            result["rows"][str(rows)] = cell
    return result


def table(results: list[dict[str, Any]]) -> str:
    names = ["rowdot", "panels", "panels_in_cache", "onednn_packed", "onednn", "aten"]
    lines = ["| weight | rows | " + " | ".join(f"{n} GB/s" for n in names) + " | sum GB/s | best kernel / packed |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for r in results:
        for rows, cell in r["rows"].items():
            rates = [f"{cell[n]['gb_per_s']:.1f}" if n in cell else "-" for n in names]
            ratio = (f"{cell['onednn_packed']['us'] / min(cell['rowdot']['us'], cell['panels']['us']):.2f}x"
                     if "rowdot" in cell else "-")
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {rows} | " + " | ".join(rates)
                         + f" | {r['sum_gb_per_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SMALL_PRESET_SHAPES, help="OUTxIN weight shapes")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/linear_rates.json")
    args = parser.parse_args()
    torch.set_num_threads(1)           # the engine runs decode-sized forwards on one thread (engine/host_threads.py)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    doc: dict[str, Any] = {"loadavg_start": list(os.getloadavg()), "cpus": os.cpu_count(), "threads": 1,
                           "rowdot": rowdot.kernel() is not None, "cpu": cpu_model(),
                           "rowdot_width": getattr(rowdot.kernel(), "width", None)}       # 512: AVX-512, 256: AVX2
    doc["results"] = [measure((out, n), args.rows, args.repeats) for out, n in shapes]
    doc["loadavg_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"load average {doc['loadavg_start']} -> {doc['loadavg_end']}\n")
    print(table(doc["results"]))


if __name__ == "__main__":
    main()
