"""Every exception maps once to an HTTP status and an OpenAI error body."""
from __future__ import annotations

import json
import logging

import pytest
from fastapi.exceptions import RequestValidationError

from shared.errors import EngineDead, InvalidSamplingParams, InvalidTokenIds, PromptTooLong, RequestTooLarge
from shared.openai.errors import (
    INTERNAL_ERROR_MESSAGE,
    BadRequest,
    ErrorResponse,
    ModelNotFound,
    OpenAIError,
    Unauthorized,
    error_from_exception,
    error_response,
)
from shared.prompt.chat import ChatTemplateError


def mapped(exc: BaseException) -> tuple[int, str, str | None, str | int | None]:
    status, body = error_from_exception(exc)
    return status, body.error.type, body.error.param, body.error.code


@pytest.mark.parametrize("exc, expected", [
    (BadRequest("bad", param="stop"), (400, "invalid_request_error", "stop", "invalid_request")),
    (Unauthorized("Incorrect API key provided."), (401, "invalid_request_error", None, "invalid_api_key")),
    (ModelNotFound("gpt-4"), (404, "invalid_request_error", "model", "model_not_found")),
    (OpenAIError("teapot", status=418, type="teapot_error", code="short"), (418, "teapot_error", None, "short")),
    (InvalidSamplingParams("top_p must be in (0, 1], got 2", param="top_p"),
     (400, "invalid_request_error", "top_p", "invalid_sampling_params")),
    (PromptTooLong(9000, 8192), (400, "invalid_request_error", "prompt", "prompt_too_long")),
    (InvalidTokenIds([1 << 20], 163840), (400, "invalid_request_error", "prompt", "invalid_token_ids")),
    (RequestTooLarge(10_000, 4096), (400, "invalid_request_error", None, "request_too_large")),
    (ChatTemplateError("messages[2] (tool) answers unknown tool_call_id 'x'"),
     (400, "invalid_request_error", "messages", "invalid_messages")),
    (json.JSONDecodeError("Expecting value", "{", 1), (400, "invalid_request_error", None, "invalid_request")),
    (EngineDead(), (503, "service_unavailable", None, "engine_dead")),
    (TimeoutError(), (504, "timeout", None, "timeout")),
    (KeyError("remote_block_ids"), (500, "server_error", None, "internal_error")),
])
def test_status_type_param_code(exc, expected):
    assert mapped(exc) == expected


def test_body_has_exactly_the_openai_keys():
    _, body = error_from_exception(ModelNotFound("gpt-4"))
    assert json.loads(body.model_dump_json()) == {"error": {
        "message": "The model `gpt-4` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}


def test_engine_messages_reach_the_client():
    _, body = error_from_exception(PromptTooLong(9000, 8192))
    assert "9000 tokens" in body.error.message and "8192" in body.error.message


def test_internal_details_stay_in_the_log(caplog):
    with caplog.at_level(logging.ERROR, logger="shared.openai.errors"):
        _, body = error_from_exception(RuntimeError("secret path /srv/keys"))
        _, dead = error_from_exception(EngineDead("engine stopped: CUDA error: device-side assert"))
    assert body.error.message == INTERNAL_ERROR_MESSAGE
    assert "CUDA" not in dead.error.message
    assert "secret path" in caplog.text and "CUDA error" in caplog.text


def test_fastapi_validation_error_drops_the_body_prefix():
    exc = RequestValidationError([{"type": "float_parsing", "loc": ("body", "temperature"),
                                   "msg": "Input should be a valid number", "input": "hot"}])
    status, body = error_from_exception(exc)
    assert (status, body.error.param) == (400, "temperature")
    assert body.error.message == "temperature: Input should be a valid number"


def test_reads_stock_vllm_error_bodies():
    vllm = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None, "code": 400}}
    assert ErrorResponse.model_validate(vllm).error.code == 400


@pytest.mark.parametrize("status, type_, code", [(400, "invalid_request_error", "invalid_request"),
                                                 (503, "service_unavailable", "service_unavailable"),
                                                 (599, "server_error", "internal_error")])
def test_error_response_defaults_by_status(status, type_, code):
    error = error_response(status, "m").error
    assert (error.type, error.code, error.param) == (type_, code, None)
