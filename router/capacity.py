"""A static worker's prefix-cache size, read once from its Prometheus /metrics.

Static workers (stock vLLM) publish no KV events, so the router's approximate index of what it
sent them must be bounded by what they can hold: an index larger than the cache routes prompts
to blocks the worker evicted long ago. vLLM exports `vllm:cache_config_info` with the engine's
`num_gpu_blocks` and `block_size` as labels; a kimi-pd worker exports its capacity directly.
`--static-cache-tokens` overrides both.
"""
from __future__ import annotations

import re

_LABELS = re.compile(r'(\w+)="([^"]*)"')
_VLLM_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_KIMI = re.compile(r"^kimi_pd_worker_capacity_tokens(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.M)


def capacity_tokens_from_metrics(text: str) -> int | None:
    """Cache capacity in tokens from a /metrics page, or None when the page does not say."""
    if m := _KIMI.search(text):
        return int(float(m.group(1))) or None
    if m := _VLLM_INFO.search(text):
        labels = dict(_LABELS.findall(m.group(1)))
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            return None
        return blocks * size or None
    return None
