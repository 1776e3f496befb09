"""What the router records of one request as it moves: the leg decisions, the workers, the transfer."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.kv_transfer_params import KVTransferParams
from shared.openai.legs import wire_body
from shared.openai.requests import SamplingRequest

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}     # endpoint -> the workers' path


@dataclass
class Trace:
    request_id: str                                  # the router's own id: what workers see (never the client's)
    endpoint: str
    client_request_id: str | None = None             # the client's validated id, for logs only
    group: str | None = None                         # a fan-out's id, shared by its sub-requests (x-kimi-pd-group)
    decision: str = "none"
    start: float = field(default_factory=time.perf_counter)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    cached_tokens: int | None = None
    kv_transfer_params: KVTransferParams | None = None
    transfer_tokens: int = 0                         # prompt tokens whose state the decode worker is to pull
    decode_params: dict | None = None                # a stock vLLM decode leg's kv_transfer_params, as sent
    kv_connector: str = "kimi-pd"                    # the P/D protocol of this request's pool
    decode_connected: bool = False
    outcome: str | None = None                       # a stream's outcome, set when its relay ends
    completion_tokens: int | None = None             # what the answer generated (admission settles by it)
    on_end: Callable[[], None] | None = None         # called once a stream's relay ends (admission)
    wire: tuple[object, dict] | None = None          # (request, its wire body): `wire_of`


def wire_of(trace: Trace, req: SamplingRequest) -> dict:
    """`req`'s wire body (`shared.openai.legs.wire_body`) as a fresh dict to edit, dumped once per request
    object: a prefill-decode request needs it for both legs, and a long history costs ~1 µs a message to
    dump. The legs edit top-level keys only; nested values are shared, read-only."""
    if trace.wire is None or trace.wire[0] is not req:       # a re-run's request is a new object
        trace.wire = (req, wire_body(req))
    return dict(trace.wire[1])


def trace_headers(trace: Trace, workers: bool) -> dict[str, str]:
    """Where a request went: its id and decision always; the workers it went to (ids, which for static
    workers are internal URLs) only when `workers` (RouterSettings.shows_placement)."""
    headers = {"x-request-id": trace.request_id, "x-kimi-pd-decision": trace.decision}
    if not workers:
        return headers
    if trace.prefill_worker:
        headers["x-kimi-pd-prefill-worker"] = trace.prefill_worker
    if trace.decode_worker:
        headers["x-kimi-pd-decode-worker"] = trace.decode_worker
    return headers
