"""A finished prefill's complete hybrid state as plain tensors: the disaggregation hand-off.

Layout (per request): `mla.{layer}` [T, kv_lora+rope] for every prompt token of every MLA layer;
`kda_conv.{layer}` [W-1, 3*H*K] and `kda_recurrent.{layer}` [H, K, V] fp32 for every KDA layer;
plus the first sampled token, its logprob and the exporter's identity. `to_parts` / `from_parts`
give the (meta, tensors) pair the transfer layer moves; the names are the wire contract.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class StateMismatch(ValueError):
    """Imported state from a model or layout this engine cannot continue."""


@dataclass(frozen=True)
class StateIdentity:
    config_hash: str
    dtype: str
    layer_schedule: str          # one letter per layer: K (KDA) or M (MLA)
    block_size: int

    def check_compatible(self, other: StateIdentity) -> None:
        """Block size may differ (pages are re-laid out on import); everything else must match."""
        for name in ("config_hash", "dtype", "layer_schedule"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise StateMismatch(f"state {name} {theirs!r} does not match this engine's {mine!r}")


@dataclass
class ExportedState:
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprob: float
    identity: StateIdentity
    mla: dict[int, torch.Tensor]
    kda_conv: dict[int, torch.Tensor]
    kda_recurrent: dict[int, torch.Tensor]
    num_cached_tokens: int = 0
    first_top_logprobs: list[tuple[int, float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    draft: dict[int, torch.Tensor] = field(default_factory=dict)   # DSpark context rows [T, dim] per draft layer

    def to_parts(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta = {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "first_token_id": self.first_token_id, "first_logprob": self.first_logprob,
                "first_top_logprobs": [list(p) for p in self.first_top_logprobs or []] or None,
                "num_cached_tokens": self.num_cached_tokens,
                "identity": vars(self.identity).copy(), "extra": self.extra}
        tensors = {**{f"mla.{i}": t for i, t in self.mla.items()},
                   **{f"kda_conv.{i}": t for i, t in self.kda_conv.items()},
                   **{f"kda_recurrent.{i}": t for i, t in self.kda_recurrent.items()},
                   **{f"draft.{j}": t for j, t in self.draft.items()}}
        return meta, tensors

    @classmethod
    def from_parts(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> ExportedState:
        groups: dict[str, dict[int, torch.Tensor]] = {"mla": {}, "kda_conv": {}, "kda_recurrent": {}, "draft": {}}
        for name, t in tensors.items():
            kind, _, layer = name.rpartition(".")
            if kind not in groups or not layer.isdigit():
                raise StateMismatch(f"unknown state tensor {name!r}")
            groups[kind][int(layer)] = t
        top = meta.get("first_top_logprobs")
        return cls(request_id=meta["request_id"], prompt_token_ids=list(meta["prompt_token_ids"]),
                   first_token_id=int(meta["first_token_id"]), first_logprob=float(meta["first_logprob"]),
                   identity=StateIdentity(**meta["identity"]), num_cached_tokens=int(meta.get("num_cached_tokens", 0)),
                   first_top_logprobs=[tuple(p) for p in top] if top else None, extra=meta.get("extra", {}),
                   **groups)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.to_parts()[1].values())
