"""What the engine reports per request per step (vLLM-shaped, plus the streaming delta)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    new_text: str = ""                                   # what this step added (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    queue_seconds: float | None = None                   # arrival -> first scheduled (None: not yet)

    @property
    def output(self) -> CompletionOutput:
        return self.outputs[0]
