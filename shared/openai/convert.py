"""Pure conversions between OpenAI requests/responses and the engine's inputs/outputs.

Requests: `to_sampling_params`, `render_options` and `chat_messages` (the arguments of
`render_chat`), `image_urls`. Outputs: `shape_chat_message` and `ChatDeltaShaper` (from
`shaping`), `chat_logprobs` and `completion_logprobs` (from `logprobs`). Every refusal raises
`shared.errors.InvalidRequest` naming the request field, which `errors.error_from_exception` maps
to a 400.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from shared.errors import InvalidRequest, InvalidSamplingParams
from shared.sampling_params import SamplingParams
from shared.prompt.chat import THINKING_EFFORTS
from shared.openai.logprobs import chat_logprobs, completion_logprobs
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.shaping import ChatDeltaShaper, ShapedMessage, shape_chat_message

__all__ = [
    "ChatDeltaShaper", "ShapedMessage", "chat_logprobs", "chat_messages", "completion_logprobs",
    "image_urls", "render_options", "shape_chat_message", "to_sampling_params",
]

AnyRequest = ChatCompletionRequest | CompletionRequest
# Fields a server default (e.g. from generation_config.json) may fill when the request omits them.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "max_tokens")
_PASSED_IF_SET = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop_token_ids")
# Features that would change the output if silently ignored: refused rather than dropped.
_UNSUPPORTED = {
    "logit_bias": "logit_bias", "prompt_logprobs": "prompt_logprobs", "use_beam_search": "beam search",
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding", "structural_tag": "guided decoding",
    "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words", "logits_processors": "logits processors",
}


def to_sampling_params(req: AnyRequest, *, defaults: Mapping[str, Any] | None = None,
                       vocab_size: int | None = None) -> SamplingParams:
    """The engine's `SamplingParams` for `req`, validated.

    Omitted fields take `defaults` (e.g. from generation_config.json), then vLLM's defaults; a
    `max_tokens` of None lets the engine use the rest of the context. Stop token ids are checked
    against the vocabulary only when `vocab_size` is given (the router may not know it). Chat
    requests decode special tokens, which the K3 parsers need (the shapers keep them out of the
    content). Raises `InvalidRequest` naming the field the client sent.
    """
    _refuse_unsupported(req)
    chat = isinstance(req, ChatCompletionRequest)
    values = {**_checked_defaults(defaults), **_given(req)}
    default_max_tokens = values.pop("max_tokens", None)
    max_tokens = req.max_new_tokens if chat else req.max_tokens
    params = SamplingParams(
        **values,
        stop=_stop_list(req.stop),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs,
        skip_special_tokens=False if chat else req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        n=req.n,
    )
    try:
        params.validate(vocab_size if vocab_size is not None else sys.maxsize)
    except InvalidSamplingParams as exc:
        raise _as_request_field(exc, req) from None
    return params


def _checked_defaults(defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    unknown = set(defaults or {}) - set(DEFAULTABLE)
    if unknown:
        raise ValueError(f"unknown default sampling parameters {sorted(unknown)}; allowed: {DEFAULTABLE}")
    return {k: v for k, v in (defaults or {}).items() if v is not None}


def _given(req: AnyRequest) -> dict[str, Any]:
    return {name: value for name in _PASSED_IF_SET if (value := getattr(req, name)) is not None}


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _refuse_unsupported(req: AnyRequest) -> None:
    extra = req.model_extra or {}
    for name, feature in _UNSUPPORTED.items():
        if extra.get(name) not in (None, False, [], {}):
            raise InvalidRequest(f"{name}: {feature} is not supported by this server", param=name)
    if extra.get("best_of") not in (None, 1):
        raise InvalidRequest("best_of: must be 1 (one completion per request)", param="best_of")
    response_format = extra.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise InvalidRequest("response_format: only {\"type\": \"text\"} is supported (no guided decoding)",
                             param="response_format")


def _as_request_field(exc: InvalidSamplingParams, req: AnyRequest) -> InvalidSamplingParams:
    """Name the field the client sent: chat's `top_logprobs` and `max_completion_tokens`."""
    renames = {}
    if isinstance(req, ChatCompletionRequest):
        renames["logprobs"] = "top_logprobs"
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
    name = renames.get(exc.param or "")
    if name is None:
        return exc
    message = name + exc.message.removeprefix(exc.param) if exc.message.startswith(exc.param) else exc.message
    return InvalidSamplingParams(message, param=name)


# ---- chat rendering ----------------------------------------------------------------------------

def render_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """Keyword arguments of `render_chat` besides the messages: tools, thinking, thinking_effort.

    Thinking is on unless `chat_template_kwargs` turns it off (`thinking` or its alias
    `enable_thinking`); the effort comes from `chat_template_kwargs.thinking_effort` or its alias
    `reasoning_effort`. Tools are declared only when `req.tools_requested` (tool_choice "none"
    hides them). Forced tool use ("required", a named function) needs constrained decoding, which
    this server does not have, so it is refused.
    """
    if req.tool_choice not in (None, "none", "auto"):
        raise InvalidRequest('tool_choice: only "auto" and "none" are supported (forcing a tool call '
                             "needs constrained decoding)", param="tool_choice")
    kwargs = req.chat_template_kwargs or {}
    thinking = _thinking(kwargs)
    tools = [tool.model_dump(mode="json", exclude_none=True) for tool in req.tools or []]
    return {
        "tools": tools if req.tools_requested else None,
        "thinking": thinking,
        "thinking_effort": _effort(kwargs, req.reasoning_effort) if thinking else None,
    }


def _thinking(kwargs: Mapping[str, Any]) -> bool:
    given = {key: kwargs[key] for key in ("thinking", "enable_thinking") if kwargs.get(key) is not None}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise InvalidRequest(f"chat_template_kwargs.{key}: must be true or false, got {value!r}",
                                 param=f"chat_template_kwargs.{key}")
    if len(set(given.values())) > 1:
        raise InvalidRequest("chat_template_kwargs: thinking and enable_thinking disagree",
                             param="chat_template_kwargs.enable_thinking")
    return next(iter(given.values()), True)


def _effort(kwargs: Mapping[str, Any], reasoning_effort: str | None) -> str | None:
    given = {name: value for name, value in (("chat_template_kwargs.thinking_effort", kwargs.get("thinking_effort")),
                                             ("reasoning_effort", reasoning_effort)) if value is not None}
    for name, value in given.items():
        if value not in THINKING_EFFORTS:
            raise InvalidRequest(f"{name}: must be one of {', '.join(THINKING_EFFORTS)}, got {value!r}", param=name)
    if len(set(given.values())) > 1:
        raise InvalidRequest("reasoning_effort: disagrees with chat_template_kwargs.thinking_effort",
                             param="reasoning_effort")
    return next(iter(given.values()), None)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for `render_chat`; the same for every round trip of `req`."""
    return [message.model_dump(mode="json", exclude_none=True) for message in req.messages]


def image_urls(req: ChatCompletionRequest) -> list[str]:
    """URLs of the request's images, in prompt order (the order `render_chat` places them)."""
    return [part.image_url.url for message in req.messages if isinstance(message.content, list)
            for part in message.content if part.image_url is not None and part.type == "image_url"]
