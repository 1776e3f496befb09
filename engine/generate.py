"""Offline single-prompt generation for `kimi-pd generate`: a thin client of the engine's `LLM`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.outputs import RequestOutput
from engine.llm import LLM
from shared.sampling_params import SamplingParams


def generate_one(model_dir: str | Path, prompt: str, images: list[Any] | None = None, max_tokens: int = 32,
                 temperature: float = 0.0, seed: int = 0, dtype: str = "float32",
                 thinking: bool = False) -> RequestOutput:
    """Render `prompt` (+ images) as one user turn, generate, return the engine's output."""
    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=1)
    content: str | list[dict[str, Any]] = prompt
    if images:
        content = [*({"type": "image", "image": img} for img in images), {"type": "text", "text": prompt}]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    return llm.chat([{"role": "user", "content": content}], params, thinking=thinking)[0]
