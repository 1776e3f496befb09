"""What a role is to the worker service: a name and the P/D legs it serves.

A leg answers requests whose `kv_transfer_params` ask for it (`KVTransferParams.leg`): the prefill
leg computes and publishes the state under a lease, the decode leg pulls it and continues. A request
without P/D params is served locally by every role. The roles themselves live in `prefill_worker/`
and `decode_worker/`; `kimi_pd/roles.py` names them all.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.outputs import RequestOutput
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.settings import TRANSFER_SECRET_ENV


@dataclass
class LegResult:
    """What the HTTP layer needs besides the outputs."""

    request_id: str
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    recomputed: bool = False
    timings: dict[str, float] = field(default_factory=lambda: {"start": time.perf_counter()})


class Leg(Protocol):
    """One leg of a disaggregated request, started and stopped with the worker."""

    kind: LegKind

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def run(self, prepared: PreparedPrompt, params: SamplingParams, ktp: KVTransferParams,
            result: LegResult) -> AsyncIterator[RequestOutput]:
        """Engine outputs for this request; fills `result` (transfer params out, pull timings)."""
        ...

    @property
    def transfer_port(self) -> int:
        """The port this leg serves transfers on (registered for decode workers to reach), or 0."""
        ...

    def release(self, request_id: str) -> bool:
        """Free a state published for `request_id` that nobody will pull (False if none)."""
        ...


# (worker runtime, kv_transfer TransferConfig, TransferMetrics) -> the leg, built when the worker starts
LegFactory = Callable[..., Leg]


@dataclass(frozen=True)
class Role:
    name: str                              # registered in the store and shown in /health
    legs: tuple[LegFactory, ...]
    transfer_required: bool                # True: refuse to start without a transfer secret

    def validate(self, transfer_secret: bytes) -> None:
        if self.transfer_required and len(transfer_secret) < 16:
            raise ValueError(f"a {self.name} worker needs a transfer secret of at least 16 bytes ({TRANSFER_SECRET_ENV})")

    def serves_transfers(self, transfer_secret: bytes) -> bool:
        """Legs start when the role needs them, or (colocated) when a transfer secret is configured."""
        return self.transfer_required or bool(transfer_secret)
