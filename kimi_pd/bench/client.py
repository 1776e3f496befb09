"""One streamed OpenAI request, timed: TTFT, inter-token latencies, end-to-end latency, usage.

Timing follows `vllm bench serve`: TTFT is the arrival of the first chunk carrying a token, every
later token chunk adds an ITL sample, and the latency ends at the last chunk with choices (the
trailing usage chunk carries no token). Unlike vLLM, a chat stream's opening role-only chunk
(`delta: {"role": "assistant", "content": ""}`) and a finish-only chunk are not counted as
tokens: servers send the first before any token is computed, which would make TTFT meaningless.
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
    temperature: float = 0.0
    api_key: str | None = field(default=None, repr=False)
    extra_body: tuple[tuple[str, Any], ...] = ()


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
    body: dict[str, Any] = {"model": s.model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": s.temperature}
    if s.backend == CHAT:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    if s.ignore_eos:
        body["ignore_eos"] = True
    body.update(dict(s.extra_body))
    return body


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


async def send(client: httpx.AsyncClient, s: RequestSettings, req: SampleRequest) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    chat = s.backend == CHAT
    st = out.start_time = time.perf_counter()
    last = st
    tokens = 0
    try:
        async with client.stream("POST", s.url, json=payload(s, req), headers=headers) as resp:
            if resp.status_code != 200:
                out.error = _error_of(resp.status_code, await resp.aread())
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    if line.startswith("event: error"):
                        out.error = "the stream ended with an error event"
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    out.error = f"stream error: {(chunk['error'] or {}).get('message', chunk['error'])}"
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
                    out.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
                choices = chunk.get("choices")
                if not choices:
                    continue
                text = _token_text(choices[0], chat)
                if text is not None:
                    if tokens == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    tokens += 1
                    out.generated_text += text
                last = now
        out.latency = last - st
        if not out.output_tokens:
            out.output_tokens = tokens
        if out.error:
            return out
        if tokens == 0:
            out.error = "the stream carried no token"
            return out
        out.success = True
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out
