"""A fake of the router's pooled worker client (router.transport.worker_http.WorkerClient): each worker
URL answers from a script, so the router core (orchestrator, legs, relay) runs in-process, in
milliseconds, with every failure the real client can raise."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.placement.pipeline import build_pipeline
from router.registry import WorkerRegistry
from router.request.trace import Trace
from router.settings import RouterSettings
from router.transport.worker_http import ConnectFailed, Disconnected, Origin
from shared.openai.requests import ChatCompletionRequest
from shared.prompt.prepare import PreparedPrompt

P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"
KTP = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "held-1",
       "remote_host": "127.0.0.1", "remote_port": 9, "remote_block_ids": [1], "transport": "tcp"}


def sse(ids: list[int], text: str = "x", finish: str | None = None, cid: str = "chatcmpl-1") -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "token_ids": ids, "finish_reason": finish}
    return b"data: " + json.dumps({"id": cid, "created": 1, "choices": [choice]}).encode() + b"\n\n"


@dataclass
class Reply:
    """One scripted answer: `fail` on send ("connect" / "disconnect"), else a status and a JSON body,
    or SSE `chunks` that end with [DONE] unless `cut` (the worker dies mid-stream)."""

    status: int = 200
    body: dict[str, Any] | bytes | None = None
    chunks: list[bytes] | None = None
    cut: bool = False
    fail: str | None = None
    headers: dict[str, str] = field(default_factory=dict)     # e.g. a decode worker's x-kv-pull-seconds


class FakeResponse:
    def __init__(self, reply: Reply) -> None:
        self.reply, self.status, self.headers = reply, reply.status, dict(reply.headers)
        self.released = self.closed = False

    async def read(self) -> bytes:
        body = self.reply.body
        return body if isinstance(body, bytes) else json.dumps(body or {}).encode()

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.reply.chunks or []:
            yield chunk
        if self.reply.cut:
            raise Disconnected("cut")
        yield b"data: [DONE]\n\n"

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeSession:
    scripts: dict[str, list[Reply]] = field(default_factory=dict)    # per worker URL
    queue: list[Reply] = field(default_factory=list)                  # in order, whichever worker is asked
    sent: list[tuple[str, dict]] = field(default_factory=list)        # (worker url, body) in order

    def origin(self, url: str) -> Origin:
        return Origin.parse(url)

    async def post(self, origin: Origin, path: str, body: bytes, headers: Any, *, connect_timeout: float,
                   read_timeout: float) -> FakeResponse:
        url = f"{origin.scheme}://{origin.host}:{origin.port}"
        self.sent.append((url, json.loads(body)))
        reply = self.scripts[url].pop(0) if url in self.scripts else self.queue.pop(0)
        if reply.fail == "connect":
            raise ConnectFailed("refused")
        if reply.fail == "disconnect":
            raise Disconnected("closed")
        return FakeResponse(reply)

    def to(self, url: str) -> list[dict]:
        return [body for where, body in self.sent if where == url]


def orchestrator(session: FakeSession, *, prefill: tuple[str, ...] = (), decode: tuple[str, ...] = (),
                 handler: Callable[[httpx.Request], httpx.Response] | None = None, **kw: Any) -> Orchestrator:
    settings = RouterSettings(model=None, served_model_name="m", block_size=4, static_prefill=prefill,
                              static_decode=decode, disagg_threshold_tokens=1, static_cache_tokens=4096,
                              admin_token="adm", **kw)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler or (lambda r: httpx.Response(404))))
    return Orchestrator(settings, WorkerRegistry(settings, None), client, build_pipeline(**settings.pipeline_spec()),
                        RouterMetrics(), settings.admin_token, session)  # type: ignore[arg-type]


def chat(stream: bool = False, **kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4, "stream": stream, **kw})


def prompt() -> PreparedPrompt:
    return PreparedPrompt(token_ids=list(range(1, 41)))


def trace() -> Trace:
    return Trace("chat-t-1", "chat")


async def body_of(resp: Any) -> bytes:
    return b"".join([piece async for piece in resp.body_iterator])


def count(orch: Orchestrator, name: str, **labels: str) -> float:
    value = orch.metrics.registry.get_sample_value(f"kimi_pd_router_{name}", labels)
    return value or 0.0
