"""The prefill leg: compute the prompt, stop after the first token, publish the state under a lease,
answer with the parameters a decode worker needs. Its rules: the answer is one JSON body (never a
stream), and it serves `/internal/kv/release` for states no decode worker will pull."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, ClassVar

from engine.core.outputs import RequestOutput
from kv_transfer.interface import KVSender, TransferConfig, make_sender
from kv_transfer.metrics import TransferMetrics
from prefill_worker.handoff import PrefillHandoff
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.openai.errors import BadRequest
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.role import EngineCallFn, LegResult, LegRoute
from worker.runtime import WorkerRuntime

MAX_RENEWED = 100_000                                  # ids in one renewal (a router's requests in flight)


async def _release(leg: PrefillLeg, body: dict[str, Any]) -> dict[str, Any]:
    """Router -> prefill worker: free a published state no decode worker will pull (client gone)."""
    request_id = body.get("request_id")
    return {"released": isinstance(request_id, str) and leg.release(request_id)}


async def _renew(leg: PrefillLeg, body: dict[str, Any]) -> dict[str, Any]:
    """Router -> prefill worker: the states its requests still wait for live `renewed_lease_s` longer."""
    ids = body.get("request_ids")
    if not isinstance(ids, list) or len(ids) > MAX_RENEWED or not all(isinstance(i, str) for i in ids):
        raise BadRequest(f"request_ids must be a list of at most {MAX_RENEWED} strings", param="request_ids")
    return {"renewed": leg.sender.renew(ids, leg.renewed_lease_s)}


class PrefillLeg:
    kind: ClassVar[LegKind] = "prefill"
    streams: ClassVar[bool] = False                     # one token, answered whole with the decode's parameters
    routes: ClassVar[tuple[LegRoute, ...]] = (("/internal/kv/release", _release), ("/internal/kv/renew", _renew))

    def __init__(self, rt: WorkerRuntime, config: TransferConfig, metrics: TransferMetrics,
                 generate: EngineCallFn) -> None:
        self.generate = generate
        self.sender: KVSender = make_sender(config, metrics)
        self.handoff = PrefillHandoff(rt.engine, self.sender, config.lease_s)
        self.renewed_lease_s = config.renewed_lease_s

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
                  result: LegResult) -> AsyncGenerator[RequestOutput, None]:
        final = None
        async with aclosing(self.generate(prepared, params, result, export_state=True)) as outputs:
            async for out in outputs:
                final = out
        assert final is not None, "the engine ended the prefill without output"
        start = time.perf_counter()
        lease_s = self.renewed_lease_s if result.lease_renewed else None    # None: the full lease
        result.kv_transfer_params = await self.handoff.publish(result.request_id, lease_s)
        result.timings["publish_s"] = time.perf_counter() - start
        result.num_cached_tokens = final.num_cached_tokens
        yield final
