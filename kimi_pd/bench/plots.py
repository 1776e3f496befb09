"""PNG plots of one benchmark run (matplotlib, Agg backend: no display needed).

  <stem>.latency_cdf.png       CDFs of TTFT, TPOT, ITL, E2EL (ms)
  <stem>.throughput.png        output tokens/s and requests active in each second
  <stem>.ttft_vs_prompt.png    TTFT against prompt length, coloured by the cached-token share
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if values_ms:
        v = np.sort(np.asarray(values_ms))
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)


def write_plots(result: dict[str, Any], detail: dict[str, Any], stem: Path) -> list[Path]:
    plt = _pyplot()
    ok = [not e for e in detail["errors"]]
    ttft = [t * 1e3 for t, good in zip(detail["ttfts"], ok, strict=False) if good]
    e2el = [t * 1e3 for t, good in zip(detail["latencies"], ok, strict=False) if good]
    itl = [g * 1e3 for gaps, good in zip(detail["itls"], ok, strict=False) if good for g in gaps]
    tpot = [(lat - t) / (n - 1) * 1e3 for lat, t, n, good in
            zip(detail["latencies"], detail["ttfts"], detail["output_lens"], ok, strict=False) if good and n > 1]
    label = result.get("label") or result.get("backend", "")
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, values, name in zip(axes.flat, (ttft, tpot, itl, e2el), ("TTFT", "TPOT", "ITL", "E2EL"), strict=False):
        _cdf(ax, values, f"{name} CDF")
    fig.suptitle(f"latency CDFs - {label}")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + ".latency_cdf.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    tokens, running = detail["output_tokens_per_s"], detail["concurrent_requests_per_s"]
    ax.plot(range(len(tokens)), tokens, label="output tokens/s", color="tab:blue")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(range(len(running)), running, label="requests active in the second", color="tab:orange")
    ax2.set_ylabel("requests active")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="lower left")
    ax.set_title(f"throughput over time - {label}")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + ".throughput.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    lens = [n for n, good in zip(detail["input_lens"], ok, strict=False) if good]
    share = [c / n if n else 0.0
             for c, n, good in zip(detail["cached_tokens"], detail["input_lens"], ok, strict=False) if good]
    points = ax.scatter(lens, ttft, c=share, cmap="viridis", vmin=0, vmax=1, s=14)
    fig.colorbar(points, ax=ax, label="cached share of the prompt")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.set_title(f"TTFT vs prompt length - {label}")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + ".ttft_vs_prompt.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
