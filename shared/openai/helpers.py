"""The OpenAI helper endpoints every kimi-pd server answers the same way (router and worker alike):
`/v1/models`, `/v1/models/{id}`, `/tokenize`, `/detokenize`, `/tokenizer_info`, and the admin-token
check. Each app says only what differs (`HelperSurface`: who may call, which names it serves, its
tokenizer); the routes, their order of checks and their errors are written once, here.
"""
from __future__ import annotations

import hmac
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shared.http import bearer_token, read_json_body
from shared.openai import tokenize as tokenize_api
from shared.openai.errors import ModelNotFound, NotFound, Unauthorized
from shared.openai.responses import ModelCard, ModelList
from shared.openai.surface import SurfaceOptions


class HelperSurface(Protocol):
    """What one server's helper endpoints read of it (kept on `app.state.helpers`)."""

    served_model_names: tuple[str, ...]          # the first is the model's name; the rest are aliases
    max_request_bytes: int
    options: SurfaceOptions                       # --enable-tokenizer-info-endpoint, ...

    def check_client(self, request: Request) -> None:
        """Raise Unauthorized unless the caller may use the OpenAI endpoints."""

    def card(self, name: str) -> ModelCard: ...

    async def tokenize(self, req: tokenize_api.TokenizeRequest) -> dict[str, Any]: ...

    def detokenize(self, req: tokenize_api.DetokenizeRequest) -> dict[str, Any]: ...

    def tokenizer_info(self) -> dict[str, Any]: ...


def install_helpers(app: FastAPI) -> None:
    for path, fn, method in (("/v1/models", _models, "GET"), ("/v1/models/{model_id:path}", _model, "GET"),
                             ("/tokenize", _tokenize, "POST"), ("/detokenize", _detokenize, "POST"),
                             ("/tokenizer_info", _tokenizer_info, "GET")):
        app.add_api_route(path, fn, methods=[method])


def check_admin(request: Request, token: str | None, message: str = "admin endpoints need the admin token") -> None:
    """The admin token (constant-time compare); without one configured, admin endpoints are closed."""
    if not token or not hmac.compare_digest(bearer_token(request).encode(), token.encode()):
        raise Unauthorized(message, code="invalid_admin_token")


def check_model(surface: HelperSurface, model: str | None) -> None:
    if model not in (None, *surface.served_model_names):
        raise ModelNotFound(model)


def _surface(request: Request) -> HelperSurface:
    surface: HelperSurface = request.app.state.helpers
    surface.check_client(request)
    return surface


async def _models(request: Request) -> JSONResponse:
    """Every served name, as vLLM lists them (aliases of one model)."""
    surface = _surface(request)
    cards = [surface.card(name) for name in surface.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


async def _model(request: Request, model_id: str) -> JSONResponse:
    surface = _surface(request)
    check_model(surface, model_id)
    return JSONResponse(surface.card(model_id).model_dump(mode="json"))


async def _tokenize(request: Request) -> JSONResponse:
    surface = _surface(request)
    req = tokenize_api.TokenizeRequest.model_validate(await read_json_body(request, surface.max_request_bytes))
    check_model(surface, req.model)
    return JSONResponse(await surface.tokenize(req))


async def _detokenize(request: Request) -> JSONResponse:
    surface = _surface(request)
    req = tokenize_api.DetokenizeRequest.model_validate(await read_json_body(request, surface.max_request_bytes))
    check_model(surface, req.model)
    return JSONResponse(surface.detokenize(req))


async def _tokenizer_info(request: Request) -> JSONResponse:
    """Off unless the server was started with vLLM's `--enable-tokenizer-info-endpoint` (it shows the chat
    template): a 404 then, as vLLM answers, which also tells lm-eval to use a local tokenizer."""
    surface = _surface(request)
    if not surface.options.enable_tokenizer_info_endpoint:
        raise NotFound("/tokenizer_info is off on this server (start it with --enable-tokenizer-info-endpoint)")
    return JSONResponse(surface.tokenizer_info())
