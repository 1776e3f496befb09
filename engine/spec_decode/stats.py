"""Speculative decoding counters with vLLM's meanings (vllm:spec_decode_*), read by the worker's metrics.

A *draft* is one verified block of one request; *draft tokens* are the tokens it proposed;
*accepted tokens* are the drafts the target kept. Acceptance length = 1 + accepted drafts (the tokens
one target step emitted for that request). Observations since the last `drain` feed histograms.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    steps_by_k: list[int] = field(default_factory=list)    # [K]: steps whose largest chosen K was K (0 = off)
    _lengths: list[int] = field(default_factory=list, repr=False)
    _draft_s: list[float] = field(default_factory=list, repr=False)
    _verify_s: list[float] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens
        self.steps_by_k = [0] * (self.num_speculative_tokens + 1)

    def record_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        with self._lock:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted
            for i in range(num_accepted):
                self.accepted_per_pos[i] += 1
            self._lengths.append(1 + num_accepted)

    def record_choice(self, k: int) -> None:
        with self._lock:
            self.steps_by_k[k] += 1

    def record_times(self, draft_s: float | None, verify_s: float | None) -> None:
        with self._lock:
            if draft_s is not None:
                self._draft_s.append(draft_s)
            if verify_s is not None:
                self._verify_s.append(verify_s)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft (1 + accepted / drafts), vLLM's 'mean acceptance length'."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def drain(self) -> dict:
        """Cumulative counters plus the observations since the last drain (thread-safe)."""
        with self._lock:
            out = {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                   "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                   "steps_by_k": list(self.steps_by_k),
                   "acceptance_lengths": self._lengths, "draft_seconds": self._draft_s,
                   "verify_seconds": self._verify_s}
            self._lengths, self._draft_s, self._verify_s = [], [], []
            return out
