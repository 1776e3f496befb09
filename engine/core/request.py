"""A request's life inside the engine. The scheduler reads and moves these; it never touches tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.hashing import ImageSpan

if TYPE_CHECKING:
    from engine.core.state_export import ExportedState
    from shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    HELD = "held"                       # prefill finished, state kept for export until released
    FINISHED = "finished"


@dataclass
class ImageInput:
    """One image of a prompt: its pad-run span (with content hash) and its encoded features [n, D]."""

    span: ImageSpan
    embeds: torch.Tensor


@dataclass(eq=False)                   # identity semantics: queues compare and hash by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    export_state: bool = False          # prefill leg: hold the state for a decode worker
    imported: ExportedState | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                   # lower first under the priority scheduling policy
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens that came from the prefix cache (first schedule)
    blocks: list[int] = field(default_factory=list)
    kda_slot: int | None = None
    resume_snapshot_slot: int | None = None   # copy this snapshot into kda_slot before the next forward
    num_published_blocks: int = 0
    snapshot_upto_blocks: int = 0       # furthest prompt block boundary with a KDA snapshot (taken or found)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    max_tokens: int = 16
    detokenizer: Any = None
    text: str = ""
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)   # drafts to verify at the next step
    spec_draft_logits: Any = None                              # [n, V] when the draft sampled
    draft_context_ready: bool = True                           # draft rows exist for every verified token
    sampling_seed: int = 0                                     # base of the per-position speculative RNG
    prompt_logprobs: list[Any] | None = None   # PromptLogprob per position (0: None) when asked for
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    grammar: Any = None                 # structured output matcher (engine.structured_output)
    group: str | None = None            # the fan-out this sequence belongs to (its request's id); None: alone

    @property
    def slot(self) -> int:
        """The working KDA slot, which the scheduler allocates before the request is first scheduled."""
        if self.kda_slot is None:
            raise RuntimeError(f"request {self.request_id} is scheduled without a KDA slot")
        return self.kda_slot

    @property
    def group_key(self) -> str:
        """Whose share of the batch this sequence counts against (engine/core/scheduler.py)."""
        return self.group if self.group is not None else self.request_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
