"""What a role is to the worker service: a name and the P/D legs it serves.

A leg answers requests whose `kv_transfer_params` ask for it (`KVTransferParams.leg`): the prefill
leg computes and publishes the state under a lease, the decode leg pulls it and continues. A request
without P/D params is served locally by every role. A leg carries its own rules: whether its answer
streams, the internal routes it adds to the worker's app, and the engine call it is handed when built;
so the worker service names no role. The roles themselves live in `prefill_worker/` and
`decode_worker/`; `kimi_pd/roles.py` names them all.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.outputs import RequestOutput
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from shared.workers import Role as RoleName
from worker.settings import TRANSFER_SECRET_ENV


@dataclass
class LegResult:
    """What the HTTP layer needs besides the outputs."""

    request_id: str
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    recomputed: bool = False
    group: str | None = None            # the fan-out this leg is one sequence of (x-kimi-pd-group)
    lease_renewed: bool = False         # the router renews a prefill state's lease (x-kimi-pd-lease-renew)
    timings: dict[str, float] = field(default_factory=lambda: {"start": time.perf_counter()})


# an admin-only POST route a leg adds to the worker's app: (path, handler(the leg, JSON body) -> JSON answer)
LegRoute = tuple[str, Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]]
# the engine call a leg is handed (worker.engine_call.EngineCall): outputs for (prepared, params, result, ...)
EngineCallFn = Callable[..., AsyncGenerator[RequestOutput, None]]


class Leg(Protocol):
    """One leg of a disaggregated request, started and stopped with the worker."""

    @property
    def kind(self) -> LegKind: ...

    @property
    def streams(self) -> bool:
        """Whether its answer streams to a client that asks for a stream."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def run(self, prepared: PreparedPrompt, params: SamplingParams, ktp: KVTransferParams,
            result: LegResult) -> AsyncGenerator[RequestOutput, None]:
        """Engine outputs for this request; fills `result` (transfer params out, pull timings)."""
        ...

    @property
    def transfer_port(self) -> int:
        """The port this leg serves transfers on (registered for decode workers to reach), or 0."""
        ...


class LegFactory(Protocol):
    """A leg's class: (worker runtime, kv_transfer TransferConfig, TransferMetrics, engine call) -> the leg,
    built when the worker starts; its kind and routes are known before (the app is built first)."""

    @property
    def kind(self) -> LegKind: ...

    @property
    def routes(self) -> tuple[LegRoute, ...]: ...

    def __call__(self, rt: Any, config: Any, metrics: Any, generate: EngineCallFn) -> Leg: ...


@dataclass(frozen=True)
class Role:
    name: RoleName                         # registered in the store and shown in /health
    legs: tuple[LegFactory, ...]
    transfer_required: bool                # True: refuse to start without a transfer secret

    def validate(self, transfer_secret: bytes) -> None:
        if self.transfer_required and len(transfer_secret) < 16:
            raise ValueError(f"a {self.name} worker needs a transfer secret of at least 16 bytes "
                             f"({TRANSFER_SECRET_ENV})")

    def serves_transfers(self, transfer_secret: bytes) -> bool:
        """Legs start when the role needs them, or (colocated) when a transfer secret is configured."""
        return self.transfer_required or bool(transfer_secret)

    def routes(self, transfer_secret: bytes) -> list[tuple[str, LegKind, Callable]]:
        """(path, leg kind, handler) of every internal route its legs add, when they will run."""
        if not self.serves_transfers(transfer_secret):
            return []
        return [(path, make.kind, handle) for make in self.legs for path, handle in make.routes]
