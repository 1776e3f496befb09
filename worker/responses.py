"""Engine outputs -> OpenAI responses and SSE chunks (chat and text completions)."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import lru_cache
from typing import Any

from engine.core.outputs import RequestOutput
from shared.openai.convert import ChatDeltaShaper, chat_logprobs, completion_logprobs, shape_chat_message
from shared.openai.logprobs import concat_logprobs, echo_logprobs, prompt_logprobs_body
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.responses import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaMessage,
    Usage,
    random_id,
)
from shared.openai.shaping import SpecialTokenStrip
from shared.openai.sse import SSE_DONE, sse_event
from shared.prompt.prepare import PreparedPrompt
from shared.prompt.tokenizer import KimiTokenizer
from worker.role import LegResult


def _token_text(tokenizer: KimiTokenizer):
    return lambda token_id: tokenizer.decode([token_id])


def _logprob_text(req: ChatCompletionRequest | CompletionRequest, tokenizer: KimiTokenizer):
    """How logprobs name tokens: their text, or vLLM's `return_tokens_as_token_ids` form `token_id:N`
    (for tokens whose text is not valid UTF-8 on its own)."""
    if (req.model_extra or {}).get("return_tokens_as_token_ids"):
        return lambda token_id: f"token_id:{token_id}"
    return _token_text(tokenizer)


def _prompt_text(req: ChatCompletionRequest, prepared: PreparedPrompt, tokenizer: KimiTokenizer) -> dict[str, Any]:
    """vLLM's `return_prompt_text`: the templated prompt the model read (on the first stream chunk)."""
    if not (req.model_extra or {}).get("return_prompt_text"):
        return {}
    return {"prompt_text": tokenizer.decode(prepared.token_ids)}


def _special_strip(req: ChatCompletionRequest, tokenizer: KimiTokenizer) -> SpecialTokenStrip | None:
    """Chat's `skip_special_tokens` (default true, as in vLLM): special tokens leave the parsed text."""
    return _strip_for(tokenizer) if req.skip_special_tokens else None


@lru_cache(maxsize=4)
def _strip_for(tokenizer: KimiTokenizer) -> SpecialTokenStrip:
    return SpecialTokenStrip(tokenizer.special_tokens)


def _wire(result: LegResult) -> dict[str, Any] | None:
    """The prefill leg's answer in its JSON form (the response body is the HTTP edge)."""
    return result.kv_transfer_params.to_dict() if result.kv_transfer_params is not None else None


def usage_of(out: RequestOutput, result: LegResult) -> Usage:
    return Usage.of(len(out.prompt_token_ids), len(out.output.token_ids), result.num_cached_tokens)


def _prompt_logprobs(req, out: RequestOutput, tokenizer: KimiTokenizer):
    """vLLM's `prompt_logprobs` body when the request asked for them."""
    if req.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return prompt_logprobs_body(out.prompt_logprobs, _token_text(tokenizer))


def _echo_text(req: CompletionRequest, out: RequestOutput, tokenizer: KimiTokenizer) -> str:
    return req.prompt if isinstance(req.prompt, str) else tokenizer.decode(out.prompt_token_ids)


def _echo_logprobs(req: CompletionRequest, out: RequestOutput, tokenizer: KimiTokenizer) -> CompletionLogprobs:
    scores = out.prompt_logprobs
    if scores is None:  # `to_sampling_params` asks for them whenever echo and logprobs are both set
        raise ValueError("an echoed completion with logprobs came without prompt logprobs")
    return echo_logprobs(out.prompt_token_ids, scores, req.logprobs or 0, _token_text(tokenizer))


def _token_ids_field(req: ChatCompletionRequest | CompletionRequest, out: RequestOutput) -> dict[str, Any]:
    """vLLM's `return_token_ids`: the choice's `token_ids`, present only when asked for."""
    return {"token_ids": list(out.output.token_ids)} if req.return_token_ids else {}


def _final(last: RequestOutput | None) -> RequestOutput:
    """A stream's last output: the engine always ends a request with a (finished) output."""
    if last is None:
        raise RuntimeError("the engine ended a request without any output")
    return last


def chat_completion(req: ChatCompletionRequest, model: str, prepared: PreparedPrompt, out: RequestOutput,
                    result: LegResult, tokenizer: KimiTokenizer) -> ChatCompletion:
    o = out.output
    shaped = shape_chat_message(o.text, thinking=prepared.thinking, tools_requested=prepared.tools_requested,
                                strip=_special_strip(req, tokenizer), cut=o.finish_reason == "length")
    logprobs = (chat_logprobs(o.token_ids, o.logprobs, o.top_logprobs, _logprob_text(req, tokenizer),
                              tokenizer.token_bytes) if req.logprobs else None)
    calls = shaped.tool_calls[:1] if req.parallel_tool_calls is False else shaped.tool_calls   # vLLM's rule
    message = ChatCompletionMessage(content=shaped.content, reasoning_content=shaped.reasoning_content,
                                    tool_calls=calls or None)
    choice = ChatCompletionChoice(message=message, logprobs=logprobs,
                                  finish_reason=shaped.finish_reason or o.finish_reason, stop_reason=o.stop_reason,
                                  **_token_ids_field(req, out))
    return ChatCompletion(model=model, choices=[choice], usage=usage_of(out, result),
                          prompt_logprobs=_prompt_logprobs(req, out, tokenizer), kv_transfer_params=_wire(result),
                          **_prompt_text(req, prepared, tokenizer))


def completion(req: CompletionRequest, model: str, out: RequestOutput, result: LegResult,
               tokenizer: KimiTokenizer) -> Completion:
    o = out.output
    prefix = _echo_text(req, out, tokenizer) if req.echo else ""
    logprobs = (completion_logprobs(o.token_ids, o.logprobs, o.top_logprobs, _logprob_text(req, tokenizer),
                                    text_offset=len(prefix))
                if req.logprobs is not None else None)
    if req.echo and logprobs is not None:
        logprobs = concat_logprobs(_echo_logprobs(req, out, tokenizer), logprobs)
    choice = CompletionChoice(text=prefix + o.text, logprobs=logprobs, finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason, prompt_logprobs=_prompt_logprobs(req, out, tokenizer),
                              **_token_ids_field(req, out))
    return Completion(model=model, choices=[choice], usage=usage_of(out, result),
                      kv_transfer_params=_wire(result))


class _TokenIds:
    """`return_token_ids`: each emitted chunk carries the ids produced since the previous one, so a
    relay knows exactly which tokens' text it has delivered (what a migration resumes from)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.pending: list[int] = []

    def add(self, out: RequestOutput) -> None:
        self.pending += out.new_token_ids

    def take(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        ids, self.pending = self.pending, []
        return {"token_ids": ids}


def _resumed_text(out: RequestOutput) -> str:
    """On a resumed request's first output: the text of the tokens delivered before the migration."""
    return out.output.text[:len(out.output.text) - len(out.new_text)]


async def chat_stream(req: ChatCompletionRequest, model: str, prepared: PreparedPrompt,
                      outputs: AsyncGenerator[RequestOutput, None], result: LegResult,
                      tokenizer: KimiTokenizer) -> AsyncGenerator[bytes, None]:
    resume = req.kimi_pd_resume
    chunk_id = resume.response_id if resume is not None and resume.response_id else random_id("chatcmpl")
    shaper = ChatDeltaShaper(thinking=prepared.thinking, tools_requested=prepared.tools_requested,
                             strip=_special_strip(req, tokenizer))
    ids = _TokenIds(req.return_token_ids)

    def chunk(delta: DeltaMessage, top: dict[str, Any] | None = None, **choice: Any) -> bytes:
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model,
                                             choices=[ChatCompletionChunkChoice(delta=delta, **choice, **ids.take())],
                                             usage=_running_usage(req, last, result), **(top or {})))

    last: RequestOutput | None = None
    if resume is None:
        yield chunk(DeltaMessage(role="assistant", content=""), _prompt_text(req, prepared, tokenizer))
    async for out in _closing(outputs):
        if last is None and resume is not None:
            shaper.feed(_resumed_text(out))             # the client has seen these deltas already
        if last is None and req.prompt_logprobs is not None:
            yield sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[],
                                                prompt_logprobs=_prompt_logprobs(req, out, tokenizer)))
        last = out
        ids.add(out)
        delta = shaper.feed(out.new_text) if out.new_text else None
        if out.finished:
            tail = shaper.finish(cut=out.output.finish_reason == "length")
            delta = _merge(delta, tail)
        if delta is not None and delta.tool_calls and req.parallel_tool_calls is False:
            delta.tool_calls = [call for call in delta.tool_calls if call.index == 0] or None    # the first call only
            delta = None if delta == DeltaMessage() else delta
        n = len(out.new_token_ids)
        logprobs = None
        if req.logprobs and n:
            o = out.output
            logprobs = chat_logprobs(o.token_ids[-n:], o.logprobs[-n:], o.top_logprobs[-n:],
                                     _logprob_text(req, tokenizer), tokenizer.token_bytes)
        if delta is not None or logprobs is not None:
            yield chunk(delta or DeltaMessage(), logprobs=logprobs)
    final = _final(last)
    o = final.output
    yield chunk(DeltaMessage(), finish_reason=shaper.finish_reason or o.finish_reason, stop_reason=o.stop_reason)
    if req.include_usage:
        yield sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage_of(final, result)))
    yield SSE_DONE


async def completion_stream(req: CompletionRequest, model: str, outputs: AsyncGenerator[RequestOutput, None],
                            result: LegResult, tokenizer: KimiTokenizer) -> AsyncGenerator[bytes, None]:
    resume = req.kimi_pd_resume
    chunk_id = resume.response_id if resume is not None and resume.response_id else random_id("cmpl")
    offset, last, ids = 0, None, _TokenIds(req.return_token_ids)
    async for out in _closing(outputs):
        first = last is None
        if first and resume is not None:
            offset = len(_resumed_text(out))
        last = out
        ids.add(out)
        n = len(out.new_token_ids)
        logprobs = None
        if req.logprobs is not None and n:
            o = out.output
            logprobs = completion_logprobs(o.token_ids[-n:], o.logprobs[-n:], o.top_logprobs[-n:],
                                           _logprob_text(req, tokenizer), text_offset=offset)
        text = out.new_text
        if first and req.echo:                  # the prompt (and its logprobs) open the stream
            prefix = _echo_text(req, out, tokenizer)
            if logprobs is not None or req.logprobs is not None:
                shifted = completion_logprobs(out.new_token_ids, out.output.logprobs[-n:] if n else [],
                                              out.output.top_logprobs[-n:] if n else [],
                                              _logprob_text(req, tokenizer), text_offset=len(prefix))
                logprobs = concat_logprobs(_echo_logprobs(req, out, tokenizer), shifted)
            text = prefix + text
        offset += len(text)
        finish = out.output.finish_reason if out.finished else None
        scores = _prompt_logprobs(req, out, tokenizer) if first else None
        # one event per engine step that produced tokens, as vLLM: a token whose text is held back (a split
        # UTF-8 character, a stripped special token) still goes out, with empty text, instead of riding on
        # the next event (clients time tokens by events)
        if text or n or logprobs is not None or finish or scores is not None:
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish,
                                      stop_reason=out.output.stop_reason if finish else None, prompt_logprobs=scores,
                                      **ids.take())
            yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[choice],
                                            usage=_running_usage(req, out, result)))
    if req.include_usage:
        yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage_of(_final(last), result)))
    yield SSE_DONE


def _running_usage(req, out: RequestOutput | None, result: LegResult) -> Usage | None:
    """vLLM's `stream_options.continuous_usage_stats`: usage so far on every chunk."""
    options = req.stream_options
    if options is None or not options.continuous_usage_stats:
        return None
    return usage_of(out, result) if out is not None else Usage.of(0, 0)


async def _closing(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
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
