"""Speculative metrics when K varies per step: vLLM's counters by delta, steps counted by K (0 = off)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from engine.spec_decode.stats import SpecDecodeStats
from worker.spec_metrics import SpecDecodeMetrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_counters_follow_varying_k_and_off_steps():
    stats, registry = SpecDecodeStats(3), CollectorRegistry()
    metrics = SpecDecodeMetrics(registry, 3, {"model_name": "m", "engine": "0"})
    for k, accepted in ((3, 3), (1, 0), (0, 0), (2, 1), (0, 0)):     # K changes, and is 0 (off) twice
        stats.record_choice(k)
        if k:
            stats.record_draft(k, accepted)
        metrics.observe(stats.drain())
    labels = {"model_name": "m", "engine": "0"}
    assert sample(registry, "vllm:spec_decode_num_drafts_total", **labels) == 3
    assert sample(registry, "vllm:spec_decode_num_draft_tokens_total", **labels) == 6
    assert sample(registry, "vllm:spec_decode_num_accepted_tokens_total", **labels) == 4
    per_pos = [sample(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **labels, position=str(i))
               for i in range(3)]
    assert per_pos == [2, 1, 1]
    steps = [sample(registry, "kimi_pd_worker_spec_decode_steps_total", num_speculative_tokens=str(k))
             for k in range(4)]
    assert steps == [2, 1, 1, 1]
    assert sample(registry, "kimi_pd_worker_spec_decode_acceptance_length_count") == 3
