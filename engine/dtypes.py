"""torch dtypes by their config / CLI names (`torch_dtype`, `--dtype`); fp64 is for oracle runs only.

Here, not in `shared.model_config`: only the engine ever turns a name into a torch dtype."""
from __future__ import annotations

TORCH_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def torch_dtype(name: str):
    """The torch dtype named `name` (ValueError for anything else)."""
    import torch
    if name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(TORCH_DTYPE_NAMES)}")
    return getattr(torch, name)
