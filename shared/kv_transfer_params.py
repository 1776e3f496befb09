"""`kv_transfer_params`, typed: the only form P/D parameters take across a function boundary.

Two directions, one type (vLLM's protocol):
- to a prefill worker: `KVTransferParams.prefill_request()` (`do_remote_decode`: compute, keep the
  state for a decode worker, answer with the parameters it needs);
- to a decode worker: what the prefill worker answered (`do_remote_prefill` plus `remote_*`).
JSON dicts exist only at the HTTP edge (`from_dict` on the way in, `to_dict` on the way out).
Fields we do not model (e.g. vLLM's `tp_size`) are kept in `extra` and forwarded unchanged.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

INTERFACE_VERSION = 1
LegKind = Literal["prefill", "decode", "local"]


@dataclass
class KVTransferParams:
    """vLLM's `kv_transfer_params` fields, plus ours (`transport`, `interface_version`, `state_bytes`)."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    transport: str | None = None
    interface_version: int = INTERFACE_VERSION
    state_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def prefill_request(cls) -> KVTransferParams:
        """What the router sends a prefill worker: compute, then hold the state for a decode worker."""
        return cls(do_remote_decode=True)

    @property
    def leg(self) -> LegKind:
        """Which leg of a disaggregated request these parameters ask for."""
        if self.do_remote_decode:
            return "prefill"
        if self.do_remote_prefill:
            return "decode"
        return "local"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field that has a value, then the unmodelled ones as received."""
        out = {name: value for name in _MODELLED if (value := getattr(self, name)) is not None}
        return {**out, **self.extra} if self.extra else out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVTransferParams:
        """Build from a JSON object; fields we do not model go to `extra` (the protocol ignores them)."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
        return cls(**{k: v for k, v in raw.items() if k in _MODELLED_SET},
                   extra={k: v for k, v in raw.items() if k not in _MODELLED_SET})

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> KVTransferParams | None:
        """`from_dict` for an optional field (None stays None)."""
        return None if raw is None else cls.from_dict(raw)


# the modelled field names, in declaration order, once: dataclasses.fields() per call was a measurable
# part of a P/D request's router CPU (benchmarks/router_overhead.py, cProfile)
_MODELLED: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVTransferParams) if f.name != "extra")
_MODELLED_SET = frozenset(_MODELLED)
