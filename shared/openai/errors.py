"""OpenAI-shaped errors, and the one place exceptions become HTTP statuses and error bodies.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

| exception                                       | status | type                  | code                       |
|-------------------------------------------------|--------|-----------------------|----------------------------|
| pydantic ValidationError, engine InvalidRequest | 400    | invalid_request_error | invalid_request / engine's |
| ChatTemplateError (messages cannot be rendered) | 400    | invalid_request_error | invalid_messages           |
| Unauthorized                                    | 401    | invalid_request_error | invalid_api_key            |
| ModelNotFound                                   | 404    | invalid_request_error | model_not_found            |
| router NoWorkerAvailable (placement found none) | 503    | service_unavailable   | no_worker_available        |
| EngineDead (detail only in the log)             | 503    | service_unavailable   | engine_dead                |
| Starlette HTTPException (unknown path, method)  | 404/405| invalid_request_error | not_found / method_not_allowed |
| TimeoutError                                    | 504    | timeout               | timeout                    |
| anything else (details only in the log)         | 500    | server_error          | internal_error             |
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from shared.errors import EngineDead, InvalidRequest
from shared.openai.base import OpenAIModel, error_location
from shared.prompt.chat import ChatTemplateError

try:  # FastAPI wraps body validation errors in its own class, with a leading "body" location
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    HAVE_FASTAPI = True
except ImportError:  # pragma: no cover - fastapi is optional for library users
    HAVE_FASTAPI = False

log = logging.getLogger(__name__)

# status -> (type, code) when the raiser gives none
_DEFAULTS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_request"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable", "service_unavailable"),
    504: ("timeout", "timeout"),
}
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."
ENGINE_DEAD_MESSAGE = "The engine has stopped and cannot serve requests; retry on another server."


class ErrorDetail(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None       # int: stock vLLM puts the HTTP status here


class ErrorResponse(OpenAIModel):
    error: ErrorDetail


def error_response(status: int, message: str, type: str | None = None, code: str | int | None = None,
                   param: str | None = None) -> ErrorResponse:
    """An error body; `type` and `code` default by status (see the module table)."""
    default_type, default_code = _DEFAULTS.get(status, _DEFAULTS[500])
    return ErrorResponse(error=ErrorDetail(message=message, type=type or default_type,
                                           param=param, code=code or default_code))


class OpenAIError(Exception):
    """An error whose status and body the raiser decides; subclasses fix the status and code."""

    status = 500
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status or self.status
        self.type = type
        self.code = code or self.code

    def response(self) -> ErrorResponse:
        return error_response(self.status, self.message, self.type, self.code, self.param)


class BadRequest(OpenAIError):
    status = 400


class Unauthorized(OpenAIError):
    status = 401


class ModelNotFound(OpenAIError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str | None) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class NotFound(OpenAIError):
    status = 404


class ServiceUnavailable(OpenAIError):
    status = 503


def error_from_exception(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for `exc`; unexpected errors are logged here."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc.response()
    if HAVE_FASTAPI and isinstance(exc, StarletteHTTPException) and exc.status_code < 500:
        message = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, str(exc.detail))
        return exc.status_code, error_response(exc.status_code, message)
    if isinstance(exc, ValidationError) or (HAVE_FASTAPI and isinstance(exc, RequestValidationError)):
        message, param = validation_message(exc.errors())
        return 400, error_response(400, message, param=param)
    if isinstance(exc, InvalidRequest):
        return 400, error_response(400, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, ChatTemplateError):
        return 400, error_response(400, str(exc), code="invalid_messages", param="messages")
    if isinstance(exc, json.JSONDecodeError):
        return 400, error_response(400, f"The request body is not valid JSON: {exc}")
    if isinstance(exc, EngineDead):
        log.error("engine dead: %s", exc.message)
        return 503, error_response(503, ENGINE_DEAD_MESSAGE, code=EngineDead.code)
    if isinstance(exc, TimeoutError):
        return 504, error_response(504, "The request timed out.")
    log.error("unhandled error while serving a request", exc_info=exc)
    return 500, error_response(500, INTERNAL_ERROR_MESSAGE)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors, naming the field at fault."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):  # FastAPI's prefix
        loc = loc[1:]
    cause = first.get("ctx", {}).get("error")
    relative = cause.param if isinstance(cause, InvalidRequest) else None
    param = error_location(loc, relative)
    text = cause.message if isinstance(cause, InvalidRequest) else first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        text = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', text)}"
    elif first.get("type") == "model_type" and not loc:
        text = "The request body must be a JSON object"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {text}{more}" if param else f"{text}{more}"), param
