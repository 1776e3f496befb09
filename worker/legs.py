"""One request through the engine, honouring vLLM's P/D protocol (`kv_transfer_params`).

The params' leg picks who serves it: `prefill` and `decode` go to the role's leg of that kind (a
role without it answers 400), `local` (no params) is an ordinary colocated request, served here.
Every leg gets the engine call at construction (worker/engine_call.py): none calls back in here.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from engine.core.inputs import Resume
from engine.core.outputs import RequestOutput
from shared.kv_transfer_params import KVTransferParams
from shared.openai.errors import BadRequest
from shared.prompt.prepare import PreparedPrompt
from shared.sampling_params import SamplingParams
from worker.role import LegResult
from worker.runtime import WorkerRuntime

_ids = itertools.count()


async def run_leg(rt: WorkerRuntime, prepared: PreparedPrompt, params: SamplingParams,
                  ktp: KVTransferParams | None, result: LegResult,
                  resume: Resume | None = None) -> AsyncGenerator[RequestOutput, None]:
    """Yield engine outputs for this request; fills `result` (transfer params, cached tokens).
    `resume` (a migrated stream) continues delivered tokens; it is only for local requests."""
    kind = ktp.leg if ktp is not None else "local"
    if resume is not None and kind != "local":
        raise BadRequest("kimi_pd_resume cannot be combined with kv_transfer_params", param="kimi_pd_resume")
    if ktp is None or kind == "local":
        stream = rt.generate(prepared, params, result, resume=resume)
    else:
        leg = rt.legs.get(kind)
        if leg is None:
            raise BadRequest(f"this worker does not serve {kind} legs (role: {rt.role.name})",
                             param="kv_transfer_params")
        stream = leg.run(prepared, params, ktp, result)
    async with aclosing(stream) as outputs:
        async for out in outputs:
            yield out


def new_request_id(prefix: str, client_id: str | None) -> str:
    """Client ids are kept for tracing but made unique, so a retried id never collides."""
    return f"{prefix}-{client_id or ''}-{next(_ids)}-{time.monotonic_ns() % 10**9}"
