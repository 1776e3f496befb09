"""The bodies of the two legs of a disaggregated request, in vLLM's P/D protocol (docs/design.md).

Bodies are built from what the client sent (`exclude_unset`), so unknown fields and vendor
extensions reach the workers unchanged and the workers render the same prompt the router hashed.
"""
from __future__ import annotations

from typing import Any

from shared.kv_transfer_params import KVTransferParams
from shared.openai.requests import SamplingRequest


def wire_body(req: SamplingRequest) -> dict[str, Any]:
    """The JSON body to forward: the client's fields (normalised), nothing the server defaulted."""
    body = req.model_dump(mode="json", exclude_unset=True)
    body.pop("kimi_pd_resume", None)                # internal (router -> decode worker): clients never steer it
    return body


def prefill_body(req: SamplingRequest, wire: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, asking the worker to keep the state for a decode.
    `wire`: `wire_body(req)` already made (a copy this edits at the top level), else it is made here.

    Both token limits are set to 1, since `max_completion_tokens` overrides `max_tokens`;
    `min_tokens` is capped at 1 so that it still fits and still bans an end token at position 1.
    """
    body = wire_body(req) if wire is None else wire
    body.pop("stream_options", None)
    body.update(max_tokens=1, stream=False, kv_transfer_params=KVTransferParams.prefill_request().to_dict())
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if body.get("min_tokens"):
        body["min_tokens"] = 1
    return body


def decode_body(req: SamplingRequest, kv_transfer_params: KVTransferParams) -> dict[str, Any]:
    """The decode leg: the client's request plus the prefill response's `kv_transfer_params`."""
    body = wire_body(req)
    body["kv_transfer_params"] = kv_transfer_params.to_dict()
    return body
