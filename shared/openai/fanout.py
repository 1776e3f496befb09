"""Several choices in one request (`n`, `best_of`, a list of prompts): one sub-request per
sequence, each an ordinary one-prompt, one-sequence request, run through the same path as any
other (router placement and P/D legs, or a worker's engine), then merged into one response.

Choice `index` follows vLLM: prompt i, sequence j -> i * n + j. Sequence j of a seeded request
samples with seed + j (the offline `LLM` does the same, so both give equal results). `best_of`
generates best_of sequences per prompt and keeps the n with the highest cumulative logprob (the
sub-requests ask for logprobs for that; they are dropped again if the client did not ask).
Sub-requests of one prompt run concurrently; their prefixes hit the prefix cache of the worker the
router places them on, which prefers the one already holding the prompt.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse

from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.sse import SSE_DONE, SSEParser, sse_event

AnyRequest = ChatCompletionRequest | CompletionRequest
R = TypeVar("R", ChatCompletionRequest, CompletionRequest)   # one endpoint's request type


@dataclass(frozen=True)
class SubRequest(Generic[R]):
    prompt_index: int
    sequence: int
    request: R


def needs_fan_out(req: AnyRequest) -> bool:
    return req.n > 1 or (isinstance(req, CompletionRequest) and (req.is_batch or (req.best_of or 1) > 1))


def split(req: R) -> list[SubRequest[R]]:
    """One sub-request per (prompt, sequence), in choice order."""
    prompts = req.prompts if isinstance(req, CompletionRequest) else [None]
    per_prompt = req.num_sequences if isinstance(req, CompletionRequest) else req.n
    wants_scores = isinstance(req, CompletionRequest) and (req.best_of or 1) > req.n and req.logprobs is None
    subs = []
    for i, prompt in enumerate(prompts):
        for j in range(per_prompt):
            update: dict[str, Any] = {"n": 1, "seed": None if req.seed is None else req.seed + j}
            if isinstance(req, CompletionRequest):
                update.update(prompt=prompt, best_of=None)
                if wants_scores:
                    update["logprobs"] = 0
            subs.append(SubRequest(i, j, req.model_copy(update=update)))
    return subs


async def fan_out(req: R, run_one: Callable[[R], Awaitable[Response]]) -> Response:
    """Run every sub-request with `run_one` (the endpoint's one-request path) and merge the answers.
    The first error answer (a non-200) is the whole request's answer; the others are closed."""
    subs = split(req)
    tasks = [asyncio.ensure_future(run_one(sub.request)) for sub in subs]
    try:
        responses = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        await _close_all([r for r in responses if r is not failed])
        return failed
    headers = {k: v for k, v in responses[0].headers.items() if k.startswith("x-")}
    if req.stream:
        return StreamingResponse(_merged_stream(req, subs, responses), media_type="text/event-stream",
                                 headers=headers)
    bodies = [json.loads(bytes(r.body)) for r in responses]
    return JSONResponse(merge_bodies(req, subs, bodies), headers=headers)


def merge_bodies(req: AnyRequest, subs: list[SubRequest], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One response body: the kept choices re-indexed, usage summed (each prompt counted once)."""
    merged = {k: v for k, v in bodies[0].items() if k not in ("choices", "usage", "kv_transfer_params")}
    n = req.n
    choices, usage = [], _Usage()
    for prompt_index in sorted({s.prompt_index for s in subs}):
        group = [(s, b) for s, b in zip(subs, bodies, strict=False) if s.prompt_index == prompt_index]
        usage.add_prompt(group[0][1].get("usage"))
        for _, body in group:
            usage.add_completion(body.get("usage"))
        kept = _best(group, n) if len(group) > n else group
        for j, (_, body) in enumerate(kept):
            choice = dict(body["choices"][0], index=prompt_index * n + j)
            if isinstance(req, CompletionRequest) and req.logprobs is None:
                choice["logprobs"] = None
            choices.append(choice)
    merged["choices"] = choices
    merged["usage"] = usage.body()
    return merged


def _best(group: list[tuple[SubRequest, dict]], n: int) -> list[tuple[SubRequest, dict]]:
    """best_of: the n sequences with the highest cumulative logprob (ties: the earlier sequence)."""
    def score(item: tuple[SubRequest, dict]) -> float:
        logprobs = item[1]["choices"][0].get("logprobs") or {}
        return sum(lp for lp in logprobs.get("token_logprobs") or [] if lp is not None)
    return sorted(group, key=lambda item: (-score(item), item[0].sequence))[:n]


class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0
        self.has_cached = False

    def add_prompt(self, usage: dict | None) -> None:
        usage = usage or {}
        self.prompt += usage.get("prompt_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.has_cached = True
            self.cached += details["cached_tokens"]

    def add_completion(self, usage: dict | None) -> None:
        self.completion += (usage or {}).get("completion_tokens", 0)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                                "total_tokens": self.prompt + self.completion}
        if self.has_cached:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return body


async def _merged_stream(req: AnyRequest, subs: list[SubRequest], responses: list[Response]) -> AsyncIterator[bytes]:
    """The sub-streams one after another, choice indices rewritten, one usage chunk and one [DONE]
    at the end. An error event in a sub-stream is relayed and ends the whole stream."""
    usage = _Usage()
    seen_prompts: set[int] = set()
    last_chunk: dict[str, Any] | None = None
    try:
        for sub, response in zip(subs, responses, strict=False):
            parser = SSEParser()
            if not isinstance(response, StreamingResponse):  # a 200 answer to a streamed request streams
                raise TypeError(f"a streamed sub-request was answered with a {type(response).__name__}")
            async for raw in response.body_iterator:
                data = raw if isinstance(raw, bytes) else raw.encode() if isinstance(raw, str) else bytes(raw)
                for event in parser.feed(data):
                    if event.is_done:
                        continue
                    if event.is_error:
                        yield sse_event(event.data, event="error")
                        yield SSE_DONE
                        return
                    chunk = event.json()
                    if chunk.get("usage") and not chunk.get("choices"):
                        if sub.prompt_index not in seen_prompts:
                            usage.add_prompt(chunk["usage"])
                        usage.add_completion(chunk["usage"])
                        last_chunk = chunk
                        continue
                    for choice in chunk.get("choices", []):
                        choice["index"] = sub.prompt_index * req.n + sub.sequence
                    yield sse_event(chunk)
            seen_prompts.add(sub.prompt_index)
        if req.include_usage and last_chunk is not None:
            yield sse_event({**last_chunk, "choices": [], "usage": usage.body()})
        yield SSE_DONE
    finally:
        await _close_all(responses)


async def _close_all(responses: list[Response]) -> None:
    for response in responses:
        iterator = getattr(response, "body_iterator", None)
        if iterator is not None and hasattr(iterator, "aclose"):
            await iterator.aclose()
