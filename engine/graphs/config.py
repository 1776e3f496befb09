"""`--compilation-config` (the vLLM fields this engine reads) and `--enforce-eager`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.json_flag import json_object

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
_KNOWN = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: str = "NONE"
    cudagraph_capture_sizes: tuple[int, ...] | None = None     # None: 1, 2, 4, 8, then every 8 up to the max
    max_cudagraph_capture_size: int | None = None               # None: the engine's max_num_seqs

    @classmethod
    def parse(cls, raw: CompilationConfig | dict[str, Any] | str | None) -> CompilationConfig:
        """A JSON string or dict as `vllm serve --compilation-config` takes; unknown keys are refused."""
        if raw is None or isinstance(raw, CompilationConfig):
            return raw or cls()
        raw = json_object(raw, "--compilation-config")
        unknown = sorted(set(raw) - _KNOWN)
        if unknown:
            raise ValueError(f"--compilation-config: unsupported keys {unknown} (supported: {sorted(_KNOWN)})")
        mode = str(raw.get("cudagraph_mode", "NONE")).upper()
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode {mode!r} is not supported (supported: {', '.join(CUDAGRAPH_MODES)})")
        sizes = raw.get("cudagraph_capture_sizes")
        if sizes is not None and (not isinstance(sizes, list) or not sizes
                                  or not all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise ValueError("cudagraph_capture_sizes must be a non-empty list of positive integers")
        top = raw.get("max_cudagraph_capture_size")
        if top is not None and (not isinstance(top, int) or top < 1):
            raise ValueError("max_cudagraph_capture_size must be a positive integer")
        return cls(mode, tuple(sorted(set(sizes))) if sizes else None, top)

    def wants_graphs(self, enforce_eager: bool) -> bool:
        return self.cudagraph_mode == "FULL_DECODE_ONLY" and not enforce_eager
