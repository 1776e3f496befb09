"""Base model and helpers for the OpenAI schemas.

Every model keeps unknown fields (`extra="allow"`): OpenAI clients send many fields we do not use,
and vendor extensions such as `kv_transfer_params` must survive a parse/serialise round trip
through the router. Unions are tagged by the input's JSON kind, so a validation error reports only
the branch the input was meant for; those tags look like `<list>` and `error_location` drops them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Strict, Tag, model_validator

from shared.errors import InvalidRequest

# Request scalars are strict, as OpenAI's API is: `true` is not the integer 1, "0.7" not a number.
# (An integer is still accepted where a number is expected.)
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

# JSON kind of an input -> the tag of the union branch for it.
_KINDS: dict[type, str] = {str: "<str>", list: "<list>", dict: "<object>"}


class OpenAIModel(BaseModel):
    """Keeps unknown fields, so they are forwarded untouched; they have no effect here."""

    model_config = ConfigDict(extra="allow")


class RequestModel(OpenAIModel):
    """A request body; a top-level `null` means "use the default", as the OpenAI API treats it."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def _kind(value: Any) -> str | None:
    """Called for every union value pydantic validates or serialises (each message, each content): the exact
    type first (what JSON gives), subclasses through the scan."""
    tag = _KINDS.get(type(value))
    if tag is not None:
        return tag
    return next((tag for kind, tag in _KINDS.items() if isinstance(value, kind)), None)


def by_kind(expected: str, **branches: Any) -> Any:
    """A union picked by the JSON kind of the input: `by_kind("...", str=A, list=B, object=C)`.

    `expected` completes "must be ..." in the error for an input of any other kind.
    """
    members = tuple(Annotated[branch, Tag(f"<{kind}>")] for kind, branch in branches.items())
    return Annotated[
        Union[members],  # noqa: UP007 - a runtime-built union needs the subscript form
        Discriminator(_kind, custom_error_type="invalid_type", custom_error_message=f"must be {expected}"),
    ]


def invalid(message: str, param: str | None = None) -> InvalidRequest:
    """An error for a validator to raise; `param` is relative to the model being validated."""
    return InvalidRequest(message, param=param)


def error_location(loc: Sequence[int | str], relative: str | None = None) -> str | None:
    """`("messages", 0, "<list>", 1, "text")` -> `"messages[0].content[1].text"`-style paths."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not (part.startswith("<") and part.endswith(">")):
            path += f".{part}" if path else part
    if relative:
        path = f"{path}.{relative}" if path and not relative.startswith("[") else path + relative
    return path or None
