"""Typed request errors, raised by the engine and the prompt path, mapped once by the services
(`shared.openai.errors`) to OpenAI-style responses.

`InvalidRequest` and its subclasses are the client's fault (HTTP 400): each message says what is
wrong and what is allowed, and `param` names the offending request field when there is one.
`EngineDead` is the server's fault: the engine loop has died and no request can be served.
Every class has a stable short `code` for the response body and for metrics.
"""
from __future__ import annotations

from collections.abc import Sequence

# How many offending token ids an `InvalidTokenIds` message lists before eliding the rest.
_MAX_IDS_SHOWN = 5


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    code = "engine_error"


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as given; `param` is the request field at fault, if any."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidSamplingParams(InvalidRequest):
    """A sampling parameter is out of range or of the wrong type."""

    code = "invalid_sampling_params"


class PromptTooLong(InvalidRequest):
    """The prompt has more tokens than the model accepts."""

    code = "prompt_too_long"

    def __init__(self, num_prompt_tokens: int, max_prompt_tokens: int) -> None:
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens, but at most {max_prompt_tokens} are allowed "
            f"(prompt tokens must be in 1..{max_prompt_tokens})",
            param="prompt",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens


class InvalidTokenIds(InvalidRequest):
    """Token ids given by the client lie outside the vocabulary."""

    code = "invalid_token_ids"

    def __init__(self, bad_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
        shown = ", ".join(str(i) for i in bad_ids[:_MAX_IDS_SHOWN])
        more = f" and {len(bad_ids) - _MAX_IDS_SHOWN} more" if len(bad_ids) > _MAX_IDS_SHOWN else ""
        super().__init__(
            f"token ids {shown}{more} are outside the vocabulary: ids must be in [0, {vocab_size})", param=param
        )
        self.bad_ids = list(bad_ids)
        self.vocab_size = vocab_size


class RequestTooLarge(InvalidRequest):
    """The request's prompt plus its output could never fit the KV cache, even running alone."""

    code = "request_too_large"

    def __init__(self, num_tokens: int, max_cache_tokens: int) -> None:
        super().__init__(
            f"the request needs {num_tokens} tokens of KV cache, but the cache holds at most "
            f"{max_cache_tokens} tokens; reduce the prompt or max_tokens so the total is at most {max_cache_tokens}",
        )
        self.num_tokens = num_tokens
        self.max_cache_tokens = max_cache_tokens


class EngineDead(EngineError):
    """The engine loop has stopped; every pending and future request fails with this."""

    code = "engine_dead"

    def __init__(self, message: str = "the engine has stopped and cannot serve requests") -> None:
        super().__init__(message)
        self.message = message
