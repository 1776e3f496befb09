"""What DSpark would give Kimi-K3 itself: a decode-speedup projection from measured acceptance.

Assumptions (state them with any figure this produces):
- decode is memory-bound: a step costs the bytes of weights it reads (KV-cache reads, compute and
  communication are left out), so a target step over T tokens costs the same as over 1 token except
  for the routed experts, which it reads once each for every distinct expert its T tokens pick;
- routing is uniform and independent: T tokens touch E * (1 - (1 - k/E)^T) of E experts;
- the draft is dense: its step reads its layers once, whatever the block; the LM head (shared by both)
  is read once per step by each;
- per-layer sizes are estimates from the public config (docs/dspark.md, Kimi-K3 projection): the
  defaults below, overridable, so the per-layer cost ratio is explicit.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.adaptive import expected_accepted_measured


@dataclass(frozen=True)
class K3Sizes:
    target_layers: int = 93
    dense_bytes_per_layer: float = 0.33e9 * 2      # attention + 2 shared experts + latent projections, bf16
    num_experts: int = 896
    experts_per_token: int = 16
    expert_bytes: float = 3 * 3584 * 3072 * 0.53  # one latent expert (gate, up, down), MXFP4 (~4.25 bits)
    draft_layers: int = 5
    draft_bytes_per_layer: float = 0.495e9 * 2    # MLA (q_lora 1536, kv_lora 512) + dense FFN 14336, bf16
    lm_head_bytes: float = 163840 * 7168 * 2


def target_step_bytes(s: K3Sizes, tokens: int) -> float:
    touched = s.num_experts * (1.0 - (1.0 - s.experts_per_token / s.num_experts) ** tokens)
    return s.target_layers * (s.dense_bytes_per_layer + s.expert_bytes * touched) + s.lm_head_bytes


def draft_step_bytes(s: K3Sizes) -> float:
    return s.draft_layers * s.draft_bytes_per_layer + s.lm_head_bytes


def project_speedup(cum_rates: list[float], k: int, batch: int, sizes: K3Sizes = K3Sizes()) -> float:
    """Projected decode tokens/s with k drafts over plain decoding at `batch` requests.

    cum_rates[i]: measured P(at least i+1 drafts accepted) per verify step (the benchmark's per-position
    rates)."""
    if k == 0:
        return 1.0
    tokens = batch * (1.0 + expected_accepted_measured(cum_rates, k))
    spec_s = target_step_bytes(sizes, batch * (k + 1)) + draft_step_bytes(sizes)
    return tokens / spec_s / (batch / target_step_bytes(sizes, batch))


def draft_to_target_layer_ratio(sizes: K3Sizes = K3Sizes()) -> float:
    """Bytes of one draft layer over one target layer at batch 1 (one token's experts)."""
    return sizes.draft_bytes_per_layer / (sizes.dense_bytes_per_layer + sizes.expert_bytes * sizes.experts_per_token)
