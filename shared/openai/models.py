"""Every OpenAI schema in one import: requests, messages, responses and stream chunks.

The definitions live in `messages`, `requests` and `responses` (each kept small); this module is
the place to import them from.
"""
from __future__ import annotations

from shared.openai.base import OpenAIModel, RequestModel
from shared.openai.messages import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from shared.openai.requests import ChatCompletionRequest, CompletionRequest, SamplingRequest, StreamOptions
from shared.openai.responses import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatLogprob,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    random_id,
)

__all__ = [
    "ChatCompletion", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionChunkChoice",
    "ChatCompletionMessage", "ChatCompletionRequest", "ChatLogprob", "ChatLogprobs", "ChatMessage",
    "Completion", "CompletionChoice", "CompletionChunk", "CompletionLogprobs", "CompletionRequest",
    "ContentPart", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "FunctionCall",
    "FunctionDefinition", "ImageURL", "ModelCard", "ModelList", "NamedToolChoice", "OpenAIModel",
    "PromptTokensDetails", "RequestModel", "SamplingRequest", "StreamOptions", "Tool", "ToolCall",
    "TopLogprob", "Usage", "random_id",
]
