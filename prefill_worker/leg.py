"""The prefill leg: compute the prompt, stop after the first token, publish the state under a lease,
answer with the parameters a decode worker needs."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.core.outputs import RequestOutput
from kv_transfer.interface import KVSender, TransferConfig, make_sender
from kv_transfer.metrics import TransferMetrics
from prefill_worker.handoff import PrefillHandoff
from shared.kv_transfer_params import KVTransferParams
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.legs import generate
from worker.role import LegResult
from worker.runtime import WorkerRuntime


class PrefillLeg:
    kind = "prefill"

    def __init__(self, rt: WorkerRuntime, config: TransferConfig, metrics: TransferMetrics) -> None:
        self.rt = rt
        self.sender: KVSender = make_sender(config, metrics)
        self.handoff = PrefillHandoff(rt.engine, self.sender, config.lease_s)

    async def start(self) -> None:
        await self.sender.start()

    async def stop(self) -> None:
        await self.sender.stop()

    @property
    def transfer_port(self) -> int:
        return self.sender.port

    def release(self, request_id: str) -> bool:
        return self.sender.abort(request_id)

    async def run(self, prepared: PreparedPrompt, params: SamplingParams, ktp: KVTransferParams,
                  result: LegResult) -> AsyncIterator[RequestOutput]:
        final = None
        async with aclosing(generate(self.rt, prepared, params, result, export_state=True)) as outputs:
            async for out in outputs:
                final = out
        start = time.perf_counter()
        result.kv_transfer_params = await self.handoff.publish(result.request_id)
        result.timings["publish_s"] = time.perf_counter() - start
        result.num_cached_tokens = final.num_cached_tokens
        yield final
