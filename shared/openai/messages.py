"""Chat messages, content parts and tools, in the shapes OpenAI clients send.

Checks here are about shape (what a K3 prompt can be rendered from); the renderer
(`shared.prompt.chat.render_chat`) re-checks what only it can know, e.g. tool-result binding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import Field, model_validator

from shared.openai.base import OpenAIModel, by_kind, invalid

Role = Literal["system", "developer", "user", "assistant", "tool"]
IMAGE_URL_SCHEMES = ("http://", "https://", "data:image/")


class ImageURL(OpenAIModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _check_scheme(self) -> ImageURL:
        # Anything else (file://, ftp://, ...) could make a worker read local files or odd hosts.
        if not self.url.startswith(IMAGE_URL_SCHEMES):
            raise invalid("must be an http(s) URL or a data:image/...;base64 URL", "url")
        return self


class ContentPart(OpenAIModel):
    """`{"type": "text", "text": ...}` or `{"type": "image_url", "image_url": {"url": ...}}`."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _check_payload(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise invalid("required for a text part", "text")
        if self.type == "image_url" and self.image_url is None:
            raise invalid("required for an image_url part (an object with a 'url')", "image_url")
        return self


if TYPE_CHECKING:  # what `by_kind` builds at runtime, spelled so the type checker can read it
    Content: TypeAlias = str | list[ContentPart]
else:
    Content = by_kind("a string or a list of content parts", str=str, list=list[ContentPart])


class FunctionCall(OpenAIModel):
    name: str = Field(min_length=1)
    arguments: str                      # a JSON object, as text (OpenAI's wire format)


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message of `messages`; which fields are required depends on `role`."""

    role: Role
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None           # assistant
    tool_call_id: str | None = None                    # tool (bound by order when absent)
    reasoning_content: str | None = None               # assistant history (vLLM extension)

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise invalid("an assistant message needs content or tool_calls", "content")
        elif self.content is None:
            raise invalid(f"a {self.role} message needs content", "content")
        elif self.tool_calls:
            raise invalid(f"only assistant messages may have tool_calls, not {self.role}", "tool_calls")
        self._check_images()
        return self

    def _check_images(self) -> None:
        if self.role == "user" or not isinstance(self.content, list):
            return
        for i, part in enumerate(self.content):
            if part.type != "text":
                raise invalid(f"{self.role} messages may contain only text parts", f"content[{i}].type")


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None           # a JSON Schema object
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str = Field(min_length=1)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = by_kind(
    '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    str=Literal["none", "auto", "required"],
    object=NamedToolChoice,
)
