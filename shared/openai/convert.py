"""Pure conversions between OpenAI requests/responses and the engine's inputs/outputs.

Requests: `to_sampling_params`, `render_options` and `chat_messages` (the arguments of
`render_chat`), `image_urls`. Outputs: `shape_chat_message` and `ChatDeltaShaper` (from
`shaping`), `chat_logprobs` and `completion_logprobs` (from `logprobs`). Every refusal raises
`shared.errors.InvalidRequest` naming the request field, which `errors.error_from_exception` maps
to a 400.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from typing import Any

from shared.errors import InvalidRequest, InvalidSamplingParams
from shared.openai.logprobs import chat_logprobs, completion_logprobs
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.shaping import ChatDeltaShaper, ShapedMessage, shape_chat_message
from shared.prompt.chat import THINKING_EFFORTS
from shared.prompt.tool_grammar import forced_tool_call_grammar
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput

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
    "use_beam_search": "beam search",
    "guided_json": "guided_* (use structured_outputs)", "guided_regex": "guided_* (use structured_outputs)",
    "guided_choice": "guided_* (use structured_outputs)", "guided_grammar": "guided_* (use structured_outputs)",
    "structural_tag": "structural tags",
    "logits_processors": "logits processors",
    "vllm_xargs": "custom logits-processor arguments (vllm_xargs)",
    "logprob_token_ids": "logprobs of chosen token ids (use logprobs / top_logprobs)",
    "prompt_embeds": "prompt embeddings (send prompt text or token ids)",
    "documents": "documents (the K3 chat template has no retrieval section)",
    "media_io_kwargs": "per-request media loading options",
    "mm_processor_kwargs": "per-request image processing options",
    "ec_transfer_params": "encoder-cache transfer (EPD disaggregation)",
    "watermarking": "watermarking",
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
    max_tokens = req.max_new_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
    params = SamplingParams(
        **values,
        stop=_stop_list(req.stop),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=_logprobs(req),
        prompt_logprobs=_prompt_logprobs(req),
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=list(req.bad_words or []),
        structured_output=_structured_output(req),
        cache_salt=req.cache_salt,
        priority=req.priority,
        skip_special_tokens=False if chat else req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        n=req.n,
        repetition_detection=_repetition_detection((req.model_extra or {}).get("repetition_detection")),
    )
    try:
        params.validate(vocab_size if vocab_size is not None else sys.maxsize)
        if params.max_tokens == 0 and not (req.prompt_logprobs is not None or getattr(req, "echo", False)):
            raise InvalidSamplingParams("max_tokens must be at least 1 unless echo or prompt_logprobs is set "
                                        "(0 scores the prompt only)", param="max_tokens")
    except InvalidSamplingParams as exc:
        raise _as_request_field(exc, req) from None
    return params


def _repetition_detection(given: Any) -> tuple[int, int, int] | None:
    """vLLM's `repetition_detection` {max_pattern_size, min_pattern_size, min_count}, checked as vLLM does;
    None (off) when absent or max_pattern_size is 0."""
    if given is None:
        return None
    names = ("max_pattern_size", "min_pattern_size", "min_count")
    if not isinstance(given, dict) or set(given) - set(names) or not all(
            isinstance(given.get(n, 0), int) and not isinstance(given.get(n, 0), bool) for n in names):
        raise InvalidRequest(f"repetition_detection: an object of integers {', '.join(names)}",
                             param="repetition_detection")
    largest, smallest, count = (given.get(n, 0) for n in names)
    if largest < 0 or smallest < 0 or smallest > largest:
        raise InvalidRequest("repetition_detection: max_pattern_size, min_pattern_size must be >= 0 with "
                             "min_pattern_size <= max_pattern_size", param="repetition_detection")
    if largest and count < 2:
        raise InvalidRequest("repetition_detection.min_count: must be >= 2", param="repetition_detection.min_count")
    return (largest, smallest, count) if largest else None


def _logprobs(req: AnyRequest) -> int | None:
    """Chat asks with `logprobs: true` plus `top_logprobs`; a completion gives the count itself."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _structured_output(req: AnyRequest) -> StructuredOutput | None:
    """From response_format / structured_outputs, or, for a forced tool call (tool_choice
    "required" or a named function), the grammar of a K3 tool call of the allowed tools."""
    extra = req.model_extra or {}
    spec = StructuredOutput.from_request(extra.get("response_format"), extra.get("structured_outputs"))
    if not isinstance(req, ChatCompletionRequest):
        return spec                 # a text prompt: the grammar applies from the first generated token
    forced = _forced_tool(req)
    thinking = _thinking(req.chat_template_kwargs or {}) and req.reasoning_effort != "none"
    if forced is None:              # thinking on: the grammar constrains the answer, after the reasoning
        return dataclasses.replace(spec, after_reasoning=True) if spec is not None and thinking else spec
    if spec is not None:
        raise InvalidRequest("tool_choice: a forced tool call cannot be combined with response_format or "
                             "structured_outputs", param="tool_choice")
    tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools or []]
    name = None if forced == "required" else forced
    return StructuredOutput("xtml", forced_tool_call_grammar(tools, thinking=thinking, name=name))


def _forced_tool(req: ChatCompletionRequest) -> str | None:
    """"required", the forced function's name, or None (auto / none). Unknown names are a 400."""
    choice = req.tool_choice
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        return "required"
    name = _choice_name(choice)
    names = [t.function.name for t in req.tools or []]
    if name not in names:
        raise InvalidRequest(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return name


def _choice_name(choice: Any) -> str | None:
    function = getattr(choice, "function", None)
    if function is None and isinstance(choice, dict):
        function = choice.get("function")
    if isinstance(function, dict):
        return function.get("name")
    return getattr(function, "name", None)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's JSON keys are strings: token ids as text."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.lstrip("-").isdigit():
            raise InvalidRequest(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _prompt_logprobs(req: AnyRequest) -> int | None:
    """vLLM's `prompt_logprobs`; a completion with `echo` and `logprobs` scores its prompt too."""
    wanted = [req.prompt_logprobs] + ([req.logprobs] if isinstance(req, CompletionRequest) and req.echo else [])
    given = [n for n in wanted if n is not None]
    return max(given) if given else None


def _checked_defaults(defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    unknown = set(defaults or {}) - set(DEFAULTABLE)
    if unknown:
        raise ValueError(f"unknown default sampling parameters {sorted(unknown)}; allowed: {DEFAULTABLE}")
    return {k: v for k, v in (defaults or {}).items() if v is not None}


def _given(req: AnyRequest) -> dict[str, Any]:
    return {name: value for name in _PASSED_IF_SET if (value := getattr(req, name)) is not None}


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


# vLLM fields that change the output when set to anything but their default: refused (400 naming the
# field) rather than silently ignored. name -> (the harmless default, why it is refused)
_ONLY_DEFAULT = {
    "add_generation_prompt": (True, "the K3 template always opens the assistant turn"),
    "continue_final_message": (False, "continuing a final assistant message is not supported"),
    "include_reasoning": (True, "reasoning is always returned in reasoning_content; turn thinking off with "
                                "chat_template_kwargs.thinking=false or reasoning_effort=\"none\""),
    "truncate_prompt_tokens": (None, "prompts are never truncated; an over-long prompt is a 400"),
    "thinking_token_budget": (None, "a thinking budget is not supported"),
    "length_penalty": (1.0, "it applies to beam search, which this server does not run"),
    "routed_experts_prompt_start": (0, "routed-expert data is not returned"),
    "stream_interval": (1, "every token is streamed as soon as it is decoded"),
    "echo": (False, "chat echo (prefixing the last assistant message) is not supported; /v1/completions echoes"),
}


def _refuse_unsupported(req: AnyRequest) -> None:
    extra = req.model_extra or {}
    for name, feature in _UNSUPPORTED.items():
        if extra.get(name) not in (None, False, [], {}):
            raise InvalidRequest(f"{name}: {feature} is not supported by this server", param=name)
    for name, (default, why) in _ONLY_DEFAULT.items():
        if name in extra and extra[name] is not None and extra[name] != default:
            raise InvalidRequest(f"{name}: only {json.dumps(default)} is supported ({why})", param=name)
    if extra.get("best_of") not in (None, 1):
        raise InvalidRequest("best_of: only /v1/completions takes best_of", param="best_of")
    if extra.get("truncation_side") not in (None, "left", "right"):
        raise InvalidRequest('truncation_side: must be "left" or "right"', param="truncation_side")


def _as_request_field(exc: InvalidSamplingParams, req: AnyRequest) -> InvalidSamplingParams:
    """Name the field the client sent: chat's `top_logprobs` and `max_completion_tokens`."""
    renames = {}
    if isinstance(req, ChatCompletionRequest):
        renames["logprobs"] = "top_logprobs"
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
    param = exc.param or ""
    name = renames.get(param)
    if name is None:
        return exc
    message = name + exc.message.removeprefix(param) if exc.message.startswith(param) else exc.message
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
    _forced_tool(req)                       # a named function must be one of the tools
    kwargs = req.chat_template_kwargs or {}
    thinking = _thinking(kwargs) and req.reasoning_effort != "none"     # vLLM: "none" turns thinking off
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


# vLLM 0.32's reasoning_effort values K3's template does not name, at the nearest K3 effort
REASONING_EFFORT_ALIASES = {"minimal": "low", "xhigh": "max"}


def _effort(kwargs: Mapping[str, Any], reasoning_effort: str | None) -> str | None:
    reasoning_effort = REASONING_EFFORT_ALIASES.get(reasoning_effort or "", reasoning_effort)
    given = {name: value for name, value in (("chat_template_kwargs.thinking_effort", kwargs.get("thinking_effort")),
                                             ("reasoning_effort", reasoning_effort)) if value not in (None, "none")}
    for name, value in given.items():
        if value not in THINKING_EFFORTS:
            accepted = [*THINKING_EFFORTS, *(REASONING_EFFORT_ALIASES if name == "reasoning_effort" else ())]
            raise InvalidRequest(f"{name}: must be one of {', '.join(accepted)}, got {value!r}", param=name)
    if len(set(given.values())) > 1:
        raise InvalidRequest("reasoning_effort: disagrees with chat_template_kwargs.thinking_effort",
                             param="reasoning_effort")
    return next(iter(given.values()), None)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for `render_chat`; the same for every round trip of `req`."""
    # one serialiser call for the list, not one per message: the same dicts (each through its own model's
    # schema either way), at a fraction of the calls for a long history
    return req.model_dump(mode="json", exclude_none=True, include={"messages"})["messages"]


def image_urls(req: ChatCompletionRequest) -> list[str]:
    """URLs of the request's images, in prompt order (the order `render_chat` places them)."""
    return [part.image_url.url for message in req.messages if isinstance(message.content, list)
            for part in message.content if part.image_url is not None and part.type == "image_url"]
