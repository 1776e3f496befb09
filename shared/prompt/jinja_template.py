"""Chat templates in Jinja, rendered the way vLLM and Hugging Face render them: a sandboxed,
immutable environment with `raise_exception` and HF's `tojson`. Used for a Hugging Face tokenizer's
template on the router and for a request's own `chat_template` (vLLM's `--trust-request-chat-template`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from shared.errors import InvalidRequest

MAX_TEMPLATE_CHARS = 64 << 10          # a request's template: larger ones are refused before compiling


def compile_template(source: str) -> Any:
    """`source` compiled in a sandbox (no attribute access to Python internals, no mutation)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=False)


@lru_cache(maxsize=16)
def _request_template(source: str) -> Any:
    return compile_template(source)


def render_request_template(source: str, **variables: Any) -> str:
    """A request's `chat_template` rendered with `variables`; any failure is the request's 400."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise InvalidRequest(f"chat_template: {len(source)} characters, over this server's limit of "
                             f"{MAX_TEMPLATE_CHARS}", param="chat_template")
    try:
        return str(_request_template(source).render(**variables))
    except Exception as exc:          # noqa: BLE001 - syntax, undefined names, raise_exception: the client's input
        raise InvalidRequest(f"chat_template: cannot render these messages: {type(exc).__name__}: {exc}",
                             param="chat_template") from None
