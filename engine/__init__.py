"""The Kimi-K3 model in PyTorch and its serving runtime."""
from __future__ import annotations

from engine.host_threads import apply_openmp_defaults

apply_openmp_defaults()          # before any engine module imports torch (engine/host_threads.py)

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """Lazy exports, so `import shared.model_config` does not load the whole runtime."""
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from shared.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
