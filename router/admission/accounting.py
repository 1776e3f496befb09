"""Per-tenant accounting on this router replica: requests, tokens, rejections and latency, in the
router's metrics (one label per tenant of the tenants file, at most `MAX_LABELLED`, the rest `other`)
and in plain counters for `/dashboard` and `GET /admin/tenants/{name}`."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0                          # summed request time (mean = seconds / requests)

    def to_dict(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "rejected": dict(self.rejected),
                "outcomes": dict(self.outcomes),
                "mean_seconds": round(self.seconds / self.requests, 4) if self.requests else None}


class Accounting:
    def __init__(self, metrics=None) -> None:
        self.metrics = metrics
        self.usage: dict[str, Usage] = defaultdict(Usage)
        # `--workers N`: the sibling router processes' `raw()` usage, added to ours in `snapshot()`
        self.siblings: Callable[[], list[dict]] | None = None
        self._seconds: dict[str, object] = {}        # histogram children: labels() takes a lock per call

    def rejected(self, label: str, reason: str) -> None:
        u = self.usage[label]
        u.rejected[reason] = u.rejected.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.tenant_rejections.labels(tenant=label, reason=reason).inc()

    def queued(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.queue_wait.observe(seconds)

    def finished(self, label: str, prompt: int, completion: int, outcome: str, seconds: float) -> None:
        u = self.usage[label]
        u.requests += 1
        u.prompt_tokens += prompt
        u.completion_tokens += completion
        u.outcomes[outcome] = u.outcomes.get(outcome, 0) + 1
        u.seconds += seconds
        if self.metrics is not None:
            m = self.metrics
            m.tenant_requests.labels(tenant=label, outcome=outcome).inc()
            m.tenant_tokens.labels(tenant=label, kind="prompt").inc(prompt)
            m.tenant_tokens.labels(tenant=label, kind="completion").inc(completion)
            child = self._seconds.get(label)
            if child is None:
                child = self._seconds[label] = m.tenant_seconds.labels(tenant=label)
            child.observe(seconds)  # type: ignore[attr-defined]

    def raw(self) -> dict[str, list]:
        """Every tenant's counters as plain values (what a sibling process adds up)."""
        return {name: [u.requests, u.prompt_tokens, u.completion_tokens, u.rejected, u.outcomes, u.seconds]
                for name, u in self.usage.items()}

    def snapshot(self) -> dict[str, dict]:
        """Per tenant usage: this process's, plus its siblings' under `--workers N` (the router's as a whole)."""
        usage = self.usage
        if self.siblings is not None:
            usage = defaultdict(Usage)
            for one in (self.raw(), *self.siblings()):
                for name, (requests, prompt, completion, rejected, outcomes, seconds) in one.items():
                    u = usage[name]
                    u.requests, u.prompt_tokens = u.requests + requests, u.prompt_tokens + prompt
                    u.completion_tokens, u.seconds = u.completion_tokens + completion, u.seconds + seconds
                    for mine, theirs in ((u.rejected, rejected), (u.outcomes, outcomes)):
                        for key, n in theirs.items():
                            mine[key] = mine.get(key, 0) + n
        return {name: u.to_dict() for name, u in sorted(usage.items())}
