"""The K3 projection section and the markdown report of benchmarks/spec_decode.py."""
from __future__ import annotations

from pathlib import Path

from engine.spec_decode.projection import K3Sizes, draft_to_target_layer_ratio, project_speedup

K3_PUBLISHED_ACCEPTANCE_LENGTH = 3.85        # Inferact/Kimi-K3-DSpark's model card (docs/dspark.md)


def geometric_rates(acceptance_length: float, k: int) -> list[float]:
    """Per-position rates P(>= i accepted) of a geometric acceptance with the given mean length at K=k."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) < acceptance_length - 1 else (lo, a)
    return [lo ** i for i in range(1, k + 1)]


def projection(measured_rates: list[float], k: int, batches: tuple[int, ...] = (1, 4, 8, 16, 64, 256)) -> dict:
    sizes = K3Sizes()
    out = {"assumptions": "memory-bound decode (a step costs the weight bytes it reads), uniform routing "
                          "(T tokens touch E(1-(1-k/E)^T) experts), dense draft read once per step, LM head read "
                          "once per step by each; sizes: engine/spec_decode/projection.py K3Sizes",
           "draft_to_target_layer_bytes_ratio": round(draft_to_target_layer_ratio(sizes), 3),
           "draft_layers": sizes.draft_layers, "target_layers": sizes.target_layers}
    for name, rates in (("measured_tiny_chat_acceptance", measured_rates),
                        ("published_k3_acceptance_3.85", geometric_rates(K3_PUBLISHED_ACCEPTANCE_LENGTH, k))):
        out[name] = {str(b): {"best_k": max(range(k + 1), key=lambda kk, b=b, r=rates: project_speedup(r, kk, b)),
                              "speedup_at_k": round(project_speedup(rates, k, b), 3),
                              "best_speedup": round(max(project_speedup(rates, kk, b) for kk in range(k + 1)), 3)}
                     for b in batches}
    return out


HISTORY = "<!-- earlier runs: kept by each new run -->"


def write_markdown(result: dict, path: Path) -> None:
    """The latest run, then whatever followed HISTORY in the file before (earlier runs' notes)."""
    old = path.read_text() if path.exists() else ""
    history = old[old.index(HISTORY):] if HISTORY in old else HISTORY + "\n"
    lines = ["# spec_decode (latest run)", "",
             f"`python -m benchmarks.spec_decode` ({result['target']} + {result['draft']}, K={result['k']}, "
             f"max {result['max_tokens']} tokens, greedy, outputs identical to plain), {result['seconds']} s, "
             f"load average {result['loadavg_start'][0]:.2f} at start, {result['loadavg_end'][0]:.2f} at end.", "",
             "| batch | plain tok/s | fixed K tok/s | adaptive tok/s | fixed / plain | adaptive / plain | "
             "adaptive / plain per round (min, median, max) | adaptive steps by K (0..K) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["speedup"]:
        spread = r.get("adaptive_speedup_by_round") or {}
        lines.append(f"| {r['batch']} | {r['plain_tok_s']} | {r['fixed_tok_s']} | {r['adaptive_tok_s']} | "
                     f"{r['fixed_speedup']}x | {r['adaptive_speedup']}x | "
                     f"{spread.get('min')}, {spread.get('median')}, {spread.get('max')} | {r['adaptive_steps_by_k']} |")
    a = result["acceptance"]
    lines += ["", f"Fixed-K acceptance: mean acceptance length {a['mean_acceptance_length']}, per position "
              f"{a['per_position_rate']}.", "", "## Kimi-K3 projection", "",
              result["k3_projection"]["assumptions"] + ".",
              "", "| acceptance | batch | best K | speedup at best K | speedup at K |", "|---|---|---|---|---|"]
    for name in ("measured_tiny_chat_acceptance", "published_k3_acceptance_3.85"):
        for b, p in result["k3_projection"][name].items():
            lines.append(f"| {name} | {b} | {p['best_k']} | {p['best_speedup']}x | {p['speedup_at_k']}x |")
    path.write_text("\n".join(lines) + "\n\n" + history)
