"""Engine outputs -> OpenAI responses and SSE chunks (chat and text completions)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from engine.core.outputs import RequestOutput
from shared.prompt.tokenizer import KimiTokenizer
from shared.openai.convert import ChatDeltaShaper, chat_logprobs, completion_logprobs, shape_chat_message
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.responses import (ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                                     ChatCompletionChunkChoice, ChatCompletionMessage, Completion, CompletionChoice,
                                     CompletionChunk, DeltaMessage, Usage, random_id)
from shared.openai.sse import SSE_DONE, sse_event
from worker.role import LegResult
from shared.prompt.prepare import PreparedPrompt


def _token_text(tokenizer: KimiTokenizer):
    return lambda token_id: tokenizer.decode([token_id])


def _wire(result: LegResult) -> dict[str, Any] | None:
    """The prefill leg's answer in its JSON form (the response body is the HTTP edge)."""
    return result.kv_transfer_params.to_dict() if result.kv_transfer_params is not None else None


def usage_of(out: RequestOutput, result: LegResult) -> Usage:
    return Usage.of(len(out.prompt_token_ids), len(out.output.token_ids), result.num_cached_tokens)


def chat_completion(req: ChatCompletionRequest, model: str, prepared: PreparedPrompt, out: RequestOutput,
                    result: LegResult, tokenizer: KimiTokenizer) -> ChatCompletion:
    o = out.output
    shaped = shape_chat_message(o.text, thinking=prepared.thinking, tools_requested=prepared.tools_requested)
    logprobs = (chat_logprobs(o.token_ids, o.logprobs, o.top_logprobs, _token_text(tokenizer), tokenizer.token_bytes)
                if req.logprobs else None)
    message = ChatCompletionMessage(content=shaped.content, reasoning_content=shaped.reasoning_content,
                                    tool_calls=shaped.tool_calls or None)
    choice = ChatCompletionChoice(message=message, logprobs=logprobs,
                                  finish_reason=shaped.finish_reason or o.finish_reason, stop_reason=o.stop_reason)
    return ChatCompletion(model=model, choices=[choice], usage=usage_of(out, result),
                          kv_transfer_params=_wire(result))


def completion(req: CompletionRequest, model: str, out: RequestOutput, result: LegResult,
               tokenizer: KimiTokenizer) -> Completion:
    o = out.output
    logprobs = (completion_logprobs(o.token_ids, o.logprobs, o.top_logprobs, _token_text(tokenizer))
                if req.logprobs is not None else None)
    choice = CompletionChoice(text=o.text, logprobs=logprobs, finish_reason=o.finish_reason, stop_reason=o.stop_reason)
    return Completion(model=model, choices=[choice], usage=usage_of(out, result),
                      kv_transfer_params=_wire(result))


async def chat_stream(req: ChatCompletionRequest, model: str, prepared: PreparedPrompt,
                      outputs: AsyncIterator[RequestOutput], result: LegResult,
                      tokenizer: KimiTokenizer) -> AsyncIterator[bytes]:
    chunk_id = random_id("chatcmpl")
    shaper = ChatDeltaShaper(thinking=prepared.thinking, tools_requested=prepared.tools_requested)

    def chunk(delta: DeltaMessage, **choice: Any) -> bytes:
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model,
                                             choices=[ChatCompletionChunkChoice(delta=delta, **choice)]))

    yield chunk(DeltaMessage(role="assistant", content=""))
    last = None
    async for out in _closing(outputs):
        last = out
        delta = shaper.feed(out.new_text) if out.new_text else None
        if out.finished:
            tail = shaper.finish()
            delta = _merge(delta, tail)
        n = len(out.new_token_ids)
        logprobs = None
        if req.logprobs and n:
            o = out.output
            logprobs = chat_logprobs(o.token_ids[-n:], o.logprobs[-n:], o.top_logprobs[-n:], _token_text(tokenizer),
                                     tokenizer.token_bytes)
        if delta is not None or logprobs is not None:
            yield chunk(delta or DeltaMessage(), logprobs=logprobs)
    o = last.output
    yield chunk(DeltaMessage(), finish_reason=shaper.finish_reason or o.finish_reason, stop_reason=o.stop_reason)
    if req.include_usage:
        yield sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage_of(last, result)))
    yield SSE_DONE


async def completion_stream(req: CompletionRequest, model: str, outputs: AsyncIterator[RequestOutput],
                            result: LegResult, tokenizer: KimiTokenizer) -> AsyncIterator[bytes]:
    chunk_id, offset, last = random_id("cmpl"), 0, None
    async for out in _closing(outputs):
        last = out
        n = len(out.new_token_ids)
        logprobs = None
        if req.logprobs is not None and n:
            o = out.output
            logprobs = completion_logprobs(o.token_ids[-n:], o.logprobs[-n:], o.top_logprobs[-n:],
                                           _token_text(tokenizer), text_offset=offset)
        offset += len(out.new_text)
        finish = out.output.finish_reason if out.finished else None
        if out.new_text or logprobs is not None or finish:
            choice = CompletionChoice(text=out.new_text, logprobs=logprobs, finish_reason=finish,
                                      stop_reason=out.output.stop_reason if finish else None)
            yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[choice]))
    if req.include_usage:
        yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage_of(last, result)))
    yield SSE_DONE


async def _closing(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Iterate and always close `outputs`, so a stream the client abandons aborts its engine request."""
    async with aclosing(outputs):
        async for out in outputs:
            yield out


def _merge(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    merged = a.model_copy()
    for name in ("content", "reasoning_content"):
        x, y = getattr(a, name), getattr(b, name)
        if y:
            setattr(merged, name, (x or "") + y)
    if b.tool_calls:
        merged.tool_calls = [*(a.tool_calls or []), *b.tool_calls]
    return merged
