"""A model-free OpenAI-compatible worker that speaks vLLM's P/D protocol, for router benchmarks and tests.

Run: `python -m tests.stub_worker --port P --role prefill|decode|both [--tokens N] [--token-delay-ms D]
[--first-token-delay-ms F] [--fast]` (a streamed reply's first token comes F + D ms after the request,
each later one D ms after the previous: known TTFT and TPOT for checking benchmark clients; `--fast`:
the same handlers behind tests/stub_fast.py's bare server, for throughput runs).

Serves `/health`, `/v1/models`, `/v1/chat/completions` and `/v1/completions` (streamed or not) with
canned content of N short words, one word per token, and `/stats` (legs served, by kind). Like a
real worker (worker/legs.py) it reads `kv_transfer_params`:

- `do_remote_decode` (prefill leg, roles prefill/both): one token, never streamed, plus top-level
  `kv_transfer_params` with `do_remote_prefill` and the `remote_*` fields a decode worker needs;
- `do_remote_prefill` (decode leg, roles decode/both): the `remote_*` fields must be present;
- neither: an ordinary request (any role).

A leg the role does not serve or malformed params get an OpenAI 400 error body. Bodies are built
as plain dicts (no validation models), so the stub's own overhead stays small.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROLES = ("prefill", "decode", "both")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
SSE_DONE = b"data: [DONE]\n\n"
_REQUIRED_REMOTE = {"remote_request_id": str, "remote_host": str, "remote_port": int}


@dataclass(frozen=True)
class StubSettings:
    role: str = "both"
    tokens: int = 16                  # completion length when max_tokens does not cap it
    token_delay_s: float = 0.0        # simulated time per generated token
    first_token_delay_s: float = 0.0  # extra time before the first token (a simulated prefill)
    max_running: int = 0              # requests generating at once, the rest wait FIFO (an engine's slots); 0: any
    served_model_name: str = "kimi-k3"
    host: str = "127.0.0.1"           # advertised as remote_host in prefill replies
    port: int = 0                     # advertised as remote_port in prefill replies


class StubError(Exception):
    """Becomes an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


@dataclass
class Leg:
    """One parsed request: what to generate and which P/D leg it is."""

    endpoint: str                      # "chat" | "completions"
    kind: str                          # "prefill" | "decode" | "local"
    request_id: str
    model: str
    num_tokens: int
    finish_reason: str
    prompt_tokens: int
    stream: bool
    include_usage: bool
    kv_in: dict[str, Any] | None
    created: int = field(default_factory=lambda: int(time.time()))


def leg_kind(kv_transfer_params: Any) -> str:
    ktp = kv_transfer_params if isinstance(kv_transfer_params, dict) else {}
    if ktp.get("do_remote_decode"):
        return "prefill"
    if ktp.get("do_remote_prefill"):
        return "decode"
    return "local"


def token_text(i: int) -> str:
    """The i-th generated token: a short word, space-separated from the previous one."""
    word = WORDS[i % len(WORDS)]
    return word if i == 0 else " " + word


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _prompt_words(body: dict[str, Any], endpoint: str) -> int:
    """A cheap stand-in for the prompt's token count: its number of words."""
    if endpoint == "completions":
        prompt = body.get("prompt", "")
        return sum(len(str(p).split()) for p in prompt) if isinstance(prompt, list) else len(str(prompt).split())
    words = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        words += len(str(content or "").split())
    return words


def _token_limit(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class Stub:
    """The request handlers, bound to one settings object and leg counters."""

    def __init__(self, settings: StubSettings) -> None:
        self.s = settings
        self.engine_id = uuid.uuid4().hex
        self.counts: Counter[str] = Counter()
        self._ids = itertools.count()
        self._slots = asyncio.Semaphore(settings.max_running) if settings.max_running > 0 else None

    # ---- parsing ------------------------------------------------------------------------------
    def parse(self, body: Any, endpoint: str) -> Leg:
        if not isinstance(body, dict):
            raise StubError(400, "the request body must be a JSON object")
        model = body.get("model") or self.s.served_model_name
        if model != self.s.served_model_name:
            raise StubError(404, f"The model `{model}` does not exist.", "model", "NotFoundError", "model_not_found")
        kind = leg_kind(body.get("kv_transfer_params"))
        self._check_leg(kind, body.get("kv_transfer_params"))
        limit = _token_limit(body)
        num_tokens = self.s.tokens if limit is None else max(0, min(limit, self.s.tokens))
        stream = bool(body.get("stream")) and kind != "prefill"     # prefill legs are never streamed
        options = body.get("stream_options") or {}
        return Leg(endpoint=endpoint, kind=kind, request_id=f"stub-{self.s.role}-{next(self._ids)}", model=model,
                   num_tokens=num_tokens, finish_reason="length" if limit is not None and limit <= self.s.tokens
                   else "stop", prompt_tokens=_prompt_words(body, endpoint), stream=stream,
                   include_usage=stream and bool(options.get("include_usage")),
                   kv_in=body.get("kv_transfer_params") if kind == "decode" else None)

    def _check_leg(self, kind: str, ktp: Any) -> None:
        if (kind, self.s.role) in (("prefill", "decode"), ("decode", "prefill")):
            raise StubError(400, f"this worker does not serve {kind} legs (role: {self.s.role})", "kv_transfer_params")
        if kind == "decode":
            missing = [k for k, t in _REQUIRED_REMOTE.items() if not isinstance(ktp.get(k), t)]
            if missing:
                raise StubError(400, f"kv_transfer_params lacks {', '.join(missing)}", "kv_transfer_params")

    # ---- bodies -------------------------------------------------------------------------------
    def transfer_params(self, leg: Leg) -> dict[str, Any]:
        """What a prefill leg hands to the decode worker (vLLM's fields)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_request_id": leg.request_id, "remote_host": self.s.host, "remote_port": self.s.port,
                "remote_block_ids": None, "remote_num_tokens": leg.prompt_tokens, "transport": "stub"}

    @staticmethod
    def usage(leg: Leg) -> dict[str, Any]:
        cached = leg.prompt_tokens if leg.kind == "decode" else 0
        return {"prompt_tokens": leg.prompt_tokens, "completion_tokens": leg.num_tokens,
                "total_tokens": leg.prompt_tokens + leg.num_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self, leg: Leg) -> dict[str, Any]:
        text = "".join(token_text(i) for i in range(leg.num_tokens))
        if leg.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": leg.finish_reason, "stop_reason": None}
            head = {"id": f"chatcmpl-{leg.request_id}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": leg.finish_reason,
                      "stop_reason": None}
            head = {"id": f"cmpl-{leg.request_id}", "object": "text_completion"}
        body = {**head, "created": leg.created, "model": leg.model, "choices": [choice], "usage": self.usage(leg)}
        if leg.kind == "prefill":
            body["kv_transfer_params"] = self.transfer_params(leg)
        return body

    async def chunks(self, leg: Leg) -> AsyncIterator[bytes]:
        """The SSE stream: one chunk per token, a finish chunk (chat), usage if asked, then [DONE]."""
        chat = leg.endpoint == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{leg.request_id}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": leg.created, "model": leg.model}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + _dumps({**head, "choices": choices, **extra}) + b"\n\n"

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        role = event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}])
        if chat and leg.num_tokens == 0:
            yield role
        async with self._slot():
            async for piece in self._tokens(leg, choice, event, chat, role):
                yield piece
        if leg.include_usage:
            yield event([], usage=self.usage(leg))
        yield SSE_DONE

    def _slot(self):
        return self._slots if self._slots is not None else contextlib.nullcontext()

    async def _tokens(self, leg: Leg, choice, event, chat: bool, role: bytes) -> AsyncIterator[bytes]:
        for i in range(leg.num_tokens):
            delay = self.s.token_delay_s + (self.s.first_token_delay_s if i == 0 else 0.0)
            if delay:
                await asyncio.sleep(delay)
            if chat and i == 0:               # as vLLM's server: the role chunk goes with the first token
                yield role
            last = i == leg.num_tokens - 1
            yield event([choice(token_text(i), leg.finish_reason if last and not chat else None)])
        if chat or leg.num_tokens == 0:
            yield event([choice(None if chat else "", leg.finish_reason)])

    # ---- routes -------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def _serve(self, request: Request, endpoint: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StubError(400, f"invalid JSON body: {exc}") from exc
        leg = self.parse(body, endpoint)
        self.counts[leg.kind] += 1
        headers = {"x-request-id": leg.request_id}
        if leg.kind == "decode":
            headers["x-kv-pull-seconds"] = "0.000000"
        if leg.stream:
            return StreamingResponse(self.chunks(leg), media_type="text/event-stream", headers=headers)
        if (self.s.token_delay_s or self.s.first_token_delay_s) and leg.num_tokens:
            async with self._slot():
                await asyncio.sleep(self.s.first_token_delay_s + self.s.token_delay_s * leg.num_tokens)
        return Response(_dumps(self.whole(leg)), media_type="application/json", headers=headers)

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "role": self.s.role, "worker_id": f"stub-{self.engine_id[:8]}"})

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.s.served_model_name, "object": "model", "created": 0, "owned_by": "kimi-pd-stub"}
        return JSONResponse({"object": "list", "data": [card]})

    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse({kind: self.counts[kind] for kind in ("prefill", "decode", "local")})


async def _stub_error(request: Request, exc: StubError) -> JSONResponse:
    error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    return JSONResponse({"error": error}, status_code=exc.status)


def create_app(settings: StubSettings) -> FastAPI:
    if settings.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {settings.role!r}")
    stub = Stub(settings)
    app = FastAPI(title=f"kimi-pd stub {settings.role} worker", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.stub = stub
    app.add_exception_handler(StubError, _stub_error)
    for path, handler, method in (("/health", stub.health, "GET"), ("/v1/models", stub.models, "GET"),
                                  ("/stats", stub.stats, "GET"), ("/v1/chat/completions", stub.chat, "POST"),
                                  ("/v1/completions", stub.completions, "POST")):
        app.add_api_route(path, handler, methods=[method])
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.stub_worker", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=ROLES, default="both")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens (words) per request")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="simulated time per token")
    p.add_argument("--first-token-delay-ms", type=float, default=0.0, help="extra time before the first token")
    p.add_argument("--served-model-name", default="kimi-k3")
    p.add_argument("--max-running", type=int, default=0, help="requests generating at once (0: any)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--fast", action="store_true",
                   help="serve with the bare asyncio + httptools server (tests/stub_fast.py), not FastAPI")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    settings = StubSettings(role=args.role, tokens=args.tokens, token_delay_s=args.token_delay_ms / 1000,
                            first_token_delay_s=args.first_token_delay_ms / 1000,
                            served_model_name=args.served_model_name, host=args.host, port=args.port,
                            max_running=args.max_running)
    if args.fast:
        from tests.stub_fast import run
        run(settings)
        return 0
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
