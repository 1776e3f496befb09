"""What the engine reports per request per step (vLLM-shaped, plus the streaming delta)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class PromptLogprob(NamedTuple):
    """One prompt token's score: its logprob and rank (1 = the most likely) under the raw
    distribution of the position before it, plus the top-n (id, logprob) alternatives, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def to_wire(self) -> list:
        return [self.token_id, self.logprob, self.rank, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, raw: list) -> PromptLogprob:
        token_id, logprob, rank, top = raw
        return cls(int(token_id), float(logprob), int(rank), [(int(i), float(lp)) for i, lp in top])


# per prompt position; position 0 has no context, so it is None (vLLM's shape)
PromptLogprobs = list[PromptLogprob | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    prompt_logprobs: PromptLogprobs | None = None        # when asked for, once the prompt is computed

    @property
    def output(self) -> CompletionOutput:
        return self.outputs[0]
