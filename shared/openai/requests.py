"""`/v1/chat/completions` and `/v1/completions` request bodies: OpenAI's fields plus vLLM's extras.

Sampling fields default to None, meaning "the server's default" (`convert.to_sampling_params`
fills them in and range-checks them through `SamplingParams.validate`); only checks about the
request's shape live here. Names, types and defaults follow vLLM's `protocol.py`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias, cast

from pydantic import Field, field_validator, model_validator

from shared.openai.base import Bool, Float, Int, OpenAIModel, RequestModel, by_kind, invalid
from shared.openai.ids import MAX_REQUEST_ID_CHARS, is_safe_request_id
from shared.openai.messages import ChatMessage, Tool, ToolChoice
from shared.sampling_params import MAX_N

if TYPE_CHECKING:  # what `by_kind` builds at runtime, spelled so the type checker can read it
    Stop: TypeAlias = str | list[str]
else:
    Stop = by_kind("a string or a list of strings", str=str, list=list[str])


class StreamOptions(OpenAIModel):
    include_usage: Bool = False                 # a last chunk with usage and no choices
    continuous_usage_stats: Bool = False        # vLLM: usage on every chunk


class ResumeSpec(OpenAIModel):
    """Router -> decode worker, migrating a stream whose decode worker died: these tokens were already
    delivered; generate the rest (the stream continues under `response_id`, without a new role chunk)."""

    token_ids: list[Int] = Field(min_length=1)
    seed_offset: Int = 0                        # draws the seeded generator already made for them
    response_id: str | None = None

    @field_validator("response_id")
    @classmethod
    def _safe_id(cls, value: str | None) -> str | None:
        if value is not None and not is_safe_request_id(value):
            raise invalid("must be a printable ASCII id")
        return value


MAX_SUB_REQUESTS = 1024      # prompts x sequences in one /v1/completions request


class SamplingRequest(RequestModel):
    """Fields shared by chat and text completions."""

    model: str | None = None                    # None: the served model
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    kv_transfer_params: dict[str, Any] | None = None    # P/D protocol; forwarded untouched
    request_id: str | None = None
    return_token_ids: Bool = False              # vLLM: each choice (and stream chunk) carries its token ids
    kimi_pd_resume: ResumeSpec | None = None    # internal (router -> decode worker); clients' are dropped
    prompt_logprobs: Int | None = None          # vLLM: per prompt token logprob, rank and top-n
    logit_bias: dict[str, Float] | None = None  # OpenAI: token id (as text) -> bias in [-100, 100]
    allowed_token_ids: list[Int] | None = None  # vLLM
    bad_words: list[str] | None = None          # vLLM
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM: only requests with the same salt share cache
    priority: Int = 0                           # vLLM: lower is served first (--scheduling-policy priority)


    @field_validator("request_id")
    @classmethod
    def _safe_request_id(cls, value: str | None) -> str | None:
        if value is not None and not is_safe_request_id(value):
            raise invalid(f"must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces or quotes")
        return value

    @field_validator("n")
    @classmethod
    def _bounded_n(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise invalid(f"must be an integer in [1, {MAX_N}], got {n}")
        return n

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise invalid("only allowed when stream is true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None               # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None       # None: "auto" with tools, "none" without
    parallel_tool_calls: Bool | None = None     # accepted; K3 decides how many calls to make
    reasoning_effort: str | None = None         # alias of chat_template_kwargs.thinking_effort
    chat_template_kwargs: dict[str, Any] | None = None  # thinking / enable_thinking, thinking_effort

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise invalid("requires logprobs to be true", "top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise invalid("requires a non-empty tools list", "tool_choice")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """The output budget: `max_completion_tokens` if given, else `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tools_requested(self) -> bool:
        """Whether tools are declared to the model and its output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"


_PROMPT_SHAPES = "a string, a list of token ids, or a list of either"
MAX_PROMPTS = 256                               # prompts of one /v1/completions request


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _check_one(prompt: Any, where: str | None) -> str | list[int]:
    if not isinstance(prompt, str) and not _is_token_ids(prompt):
        raise invalid(f"must be {_PROMPT_SHAPES}", where)
    if not prompt:
        raise invalid("must not be empty", where)
    return prompt


def _check_prompt(prompt: Any) -> str | list[int] | list[str | list[int]]:
    """One prompt, or a batch (a list of strings or of token-id lists); a one-element batch is unwrapped."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        if len(prompt) == 1:
            return _check_one(prompt[0], None)
        return [_check_one(p, f"[{i}]") for i, p in enumerate(prompt)]
    return _check_one(prompt, None)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]   # a one-element batch is unwrapped
    max_tokens: Int | None = 16                 # OpenAI's and vLLM's default for completions
    logprobs: Int | None = None
    echo: Bool = False                          # the prompt (and, with logprobs, its logprobs) first
    suffix: str | None = None
    best_of: Int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        return _check_prompt(prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or many."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return list(p)
        return [cast("str | list[int]", p)]  # a list whose first item is an int is one token-id prompt

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt of a request that is not a batch (batches are fanned out into single-prompt
        sub-requests before a prompt is prepared); raises ValueError on a batch."""
        prompts = self.prompts
        if len(prompts) != 1:
            raise ValueError(f"a batch of {len(prompts)} prompts has no single prompt; fan it out first")
        return prompts[0]

    @property
    def is_batch(self) -> bool:
        return len(self.prompts) > 1

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise invalid("not supported (the model has no fill-in-the-middle mode)")
        return suffix

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of > MAX_N:
            raise invalid(f"must be at most {MAX_N}, got {self.best_of}", "best_of")
        if len(self.prompts) * self.num_sequences > MAX_SUB_REQUESTS:
            raise invalid(f"{len(self.prompts)} prompts x {self.num_sequences} sequences is over "
                          f"{MAX_SUB_REQUESTS} sequences per request", "prompt")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise invalid(f"must be at least n ({self.n}), got {self.best_of}", "best_of")
            if self.stream and self.best_of > 1:
                raise invalid("is not supported with stream (the best sequences are known only at the end)",
                              "best_of")
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: best_of if given, else n."""
        return self.best_of or self.n

