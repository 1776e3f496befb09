"""The decode leg: pull the prefill worker's state (always releasing its lease), continue from it.
If it cannot be loaded, `kv_load_failure_policy` decides: `recompute` locally or fail with 503.
Its rules: the answer streams when the client asks; it adds no routes (it holds nothing for others)."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import ClassVar

from decode_worker.pull import KVLoadFailed, StatePuller
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from kv_transfer.interface import KVReceiver, TransferConfig, make_receiver
from kv_transfer.metrics import TransferMetrics
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.openai.errors import ServiceUnavailable
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.role import EngineCallFn, LegResult, LegRoute
from worker.runtime import WorkerRuntime


class DecodeLeg:
    kind: ClassVar[LegKind] = "decode"
    streams: ClassVar[bool] = True
    routes: ClassVar[tuple[LegRoute, ...]] = ()
    transfer_port = 0

    def __init__(self, rt: WorkerRuntime, config: TransferConfig, metrics: TransferMetrics,
                 generate: EngineCallFn) -> None:
        self.rt, self.generate = rt, generate
        self.receiver: KVReceiver = make_receiver(config, metrics)
        self.puller = StatePuller(self.receiver, rt.settings.kv_load_failure_policy)

    async def start(self) -> None:
        await self.receiver.start()

    async def stop(self) -> None:
        await self.receiver.stop()

    async def run(self, prepared: PreparedPrompt, params: SamplingParams, ktp: KVTransferParams,
                  result: LegResult) -> AsyncGenerator[RequestOutput, None]:
        imported = await self._pull(prepared, ktp, result)
        async with aclosing(self.generate(prepared, params, result, imported=imported)) as outputs:
            async for out in outputs:
                yield out

    async def _pull(self, prepared: PreparedPrompt, ktp: KVTransferParams, result: LegResult) -> ExportedState | None:
        try:
            pulled = await self.puller.pull(ktp, prepared.token_ids)
        except KVLoadFailed as exc:
            self.rt.metrics.kv_pull_failures.labels(policy="fail").inc()
            raise ServiceUnavailable(str(exc), code="kv_load_failed") from exc
        self.rt.metrics.kv_pull.observe(pulled.seconds)
        result.timings["kv_pull_s"] = pulled.seconds
        if pulled.state is None:
            self.rt.metrics.kv_pull_failures.labels(policy="recompute").inc()
            result.recomputed = True
        return pulled.state
