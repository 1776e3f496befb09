"""Speculative decoding metrics of a speculating (decode or colocated) worker, vLLM's `spec_decode_*` meanings.

  kimi_pd_worker_spec_decode_num_drafts_total                   verified draft blocks
  kimi_pd_worker_spec_decode_num_draft_tokens_total             tokens those blocks proposed
  kimi_pd_worker_spec_decode_num_accepted_tokens_total          proposed tokens the target kept
  kimi_pd_worker_spec_decode_num_accepted_tokens_per_pos_total{position}
  kimi_pd_worker_spec_decode_acceptance_length                  histogram: tokens emitted per draft (1 + accepted)
  kimi_pd_worker_spec_decode_draft_seconds / _verify_seconds    histograms: draft forward (context rows +
                                                                proposal) and target verify step, per step
  kimi_pd_worker_spec_decode_steps_total{num_speculative_tokens} steps by the largest K drafted for them
                                                                (0: speculation off; the adaptive policy's choices)

Mean acceptance length = 1 + accepted / drafts; acceptance rate = accepted / draft tokens.

The four counters are also exported under vLLM's names and labels (`vllm:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`,
each with `model_name` and `engine`), so vLLM's speculative-decoding panels read a DSpark worker.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, num_speculative_tokens: int,
                 vllm_labels: dict[str, str] | None = None) -> None:
        p, r = "kimi_pd_worker_spec_decode_", registry
        self.drafts = Counter(p + "num_drafts", "Speculative draft blocks verified", registry=r)
        self.draft_tokens = Counter(p + "num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(p + "num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter(p + "num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the block",
                               ["position"], registry=r)
        self.length = Histogram(p + "acceptance_length", "Tokens emitted per verified draft (1 + accepted)",
                                buckets=tuple(range(1, num_speculative_tokens + 2)), registry=r)
        self.draft_s = Histogram(p + "draft_seconds", "Draft time per engine step", buckets=_TIME_BUCKETS, registry=r)
        self.verify_s = Histogram(p + "verify_seconds", "Target verification time per engine step",
                                  buckets=_TIME_BUCKETS, registry=r)
        self.steps = Counter(p + "steps", "Engine steps by the largest number of tokens drafted (0: off)",
                             ["num_speculative_tokens"], registry=r)
        self._seen_steps = [0] * (num_speculative_tokens + 1)
        self._seen = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._seen_pos = [0] * num_speculative_tokens
        self._vllm: dict[str, Counter] = {}
        self._vllm_pos: list[Counter] = []
        if vllm_labels is not None:
            names = list(vllm_labels)
            for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                             ("num_draft_tokens", "Number of draft tokens."),
                             ("num_accepted_tokens", "Number of accepted tokens.")):
                self._vllm[key] = Counter("vllm:spec_decode_" + key, doc, names, registry=r).labels(**vllm_labels)
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              [*names, "position"], registry=r)
            self._vllm_pos = [per_pos.labels(**vllm_labels, position=str(i)) for i in range(num_speculative_tokens)]

    def observe(self, drained: dict) -> None:
        """Fold one `SpecDecodeStats.drain()` in (counters by delta, histograms by observation)."""
        for key, counter in (("num_drafts", self.drafts), ("num_draft_tokens", self.draft_tokens),
                             ("num_accepted_tokens", self.accepted)):
            counter.inc(drained[key] - self._seen[key])
            if key in self._vllm:
                self._vllm[key].inc(drained[key] - self._seen[key])
            self._seen[key] = drained[key]
        for i, total in enumerate(drained["accepted_per_pos"]):
            self.per_pos.labels(position=str(i)).inc(total - self._seen_pos[i])
            if self._vllm_pos:
                self._vllm_pos[i].inc(total - self._seen_pos[i])
            self._seen_pos[i] = total
        for k, total in enumerate(drained.get("steps_by_k", ())):
            self.steps.labels(num_speculative_tokens=str(k)).inc(total - self._seen_steps[k])
            self._seen_steps[k] = total
        for value in drained["acceptance_lengths"]:
            self.length.observe(value)
        for value in drained["draft_seconds"]:
            self.draft_s.observe(value)
        for value in drained["verify_seconds"]:
            self.verify_s.observe(value)
