"""One streamed OpenAI request, timed: TTFT, inter-token latencies, end-to-end latency, usage.

Timing and counting are `vllm bench serve`'s (vLLM 0.32, `benchmarks/lib/endpoint_request_func.py`):
the stream is split into SSE messages at blank lines, and every message whose `choices` is not empty
is one event: the first sets TTFT, each later one adds an ITL sample, and the latency ends at the last
such event (the trailing usage chunk has no choices). A chat stream's opening role chunk and its
finish chunk count like any other, as vLLM counts them; servers (vLLM's and ours) send the role
chunk with the first token, not before it. The request body is vLLM's too: no sampling parameter is
sent unless given (the server's defaults apply), completions carry `repetition_penalty: 1.0` and
`logprobs`, chat sends one user message with a text part and `max_completion_tokens`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kimi_pd.bench.datasets import SampleRequest

CHAT, COMPLETIONS = "openai-chat", "openai"


@dataclass(frozen=True)
class RequestSettings:
    url: str                               # full endpoint URL
    backend: str                           # CHAT or COMPLETIONS
    model: str
    ignore_eos: bool = False
    temperature: float | None = None       # None: not sent, the server's default applies (as vLLM's client)
    api_key: str | None = field(default=None, repr=False)
    extra_body: tuple[tuple[str, Any], ...] = ()     # sampling parameters given, then --extra-body
    logprobs: int | None = None
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)    # --header KEY=VALUE
    request_id_prefix: str | None = None   # x-request-id: prefix + the request's index


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0                # perf_counter at send
    queue_time: float = 0.0                # waiting for a --max-concurrency slot
    generated_text: str = ""
    error: str = ""


def payload(s: RequestSettings, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": s.model}
    if s.backend == CHAT:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": req.prompt}]}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body.update(prompt=req.prompt, repetition_penalty=1.0, max_tokens=req.expected_output_len,
                    logprobs=s.logprobs)
    body.update(stream=True, stream_options={"include_usage": True})
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.temperature is not None:
        body["temperature"] = s.temperature
    body.update(dict(s.extra_body))
    return body


def request_headers(s: RequestSettings, req: SampleRequest) -> dict[str, str]:
    headers = dict(s.headers)
    if s.api_key:
        headers["Authorization"] = f"Bearer {s.api_key}"
    if s.request_id_prefix is not None:
        headers["x-request-id"] = s.request_id_prefix + req.request_id.rpartition("-")[2]
    return headers


class SSEMessages:
    """Bytes of a stream -> its complete SSE messages (split at blank lines, as vLLM's client splits)."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text.replace("\r\n", "\n")
        *messages, self.buffer = self.buffer.split("\n\n")
        return [m.strip() for m in messages if m.strip()]

    def rest(self) -> list[str]:
        """At the end of the stream: an unterminated last message, if any."""
        last, self.buffer = self.buffer.strip(), ""
        return [last] if last else []


def _token_text(choice: dict[str, Any], chat: bool) -> str | None:
    """The chunk's generated text ("" for an empty token step), or None if it carries no token."""
    if not chat:
        text = choice.get("text")
        if not text and choice.get("finish_reason") is not None:
            return None
        return text or ""
    delta = choice.get("delta") or {}
    text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    if text or delta.get("tool_calls"):
        return text
    if "role" in delta or choice.get("finish_reason") is not None or not delta:
        return None                        # role announcement, or the finish-only chunk
    return ""


def _error_of(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:300].decode(errors="replace")
    return f"HTTP {status}: {message}"


def _data(message: str) -> tuple[str | None, bool]:
    """An SSE message's data (None when it has none) and whether it is an `event: error` message."""
    lines = message.split("\n")
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    return ("\n".join(data) if data else None), any(line.strip() == "event: error" for line in lines)


class _Timer:
    """vLLM's clock over one stream: TTFT at the first event with choices, ITL between later ones."""

    def __init__(self, out: RequestOutput, start: float) -> None:
        self.out, self.start, self.last, self.events = out, start, start, 0

    def event(self, now: float) -> None:
        if self.events == 0:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.events += 1
        self.last = now


def _take(out: RequestOutput, timer: _Timer, message: str, chat: bool) -> bool:
    """Fold one SSE message in; True at [DONE]."""
    data, is_error = _data(message)
    if is_error:
        out.error = "the stream ended with an error event"
    if data is None or is_error:
        return False
    if data == "[DONE]":
        return True
    now = time.perf_counter()
    chunk = json.loads(data)
    if "error" in chunk and not chunk.get("choices"):
        out.error = f"stream error: {(chunk['error'] or {}).get('message', chunk['error'])}"
        return False
    if choices := chunk.get("choices"):
        timer.event(now)
        out.generated_text += _token_text(choices[0], chat) or ""
    elif usage := chunk.get("usage"):
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
        out.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return False


async def send(client: httpx.AsyncClient, s: RequestSettings, req: SampleRequest) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    chat = s.backend == CHAT
    st = out.start_time = time.perf_counter()
    timer = _Timer(out, st)
    try:
        async with client.stream("POST", s.url, json=payload(s, req), headers=request_headers(s, req)) as resp:
            if resp.status_code != 200:
                out.error = _error_of(resp.status_code, await resp.aread())
                return out
            messages, done = SSEMessages(), False
            async for text in resp.aiter_text():
                for message in messages.feed(text):
                    done = done or _take(out, timer, message, chat)
            for message in messages.rest():
                done = done or _take(out, timer, message, chat)
        out.latency = timer.last - st
        if not out.output_tokens:
            out.output_tokens = timer.events
        if not out.error and timer.events == 0:
            out.error = "the stream carried no token"
        out.success = not out.error
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out
