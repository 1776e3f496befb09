"""The worker's side of the shared OpenAI helper endpoints (shared/openai/helpers.py): its API key or the
routers' internal token, its one served name, and its engine's tokenizer (tokenising off the event loop)."""
from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import Request

from shared.http import bearer_token
from shared.openai import tokenize as tokenize_api
from shared.openai.errors import Unauthorized
from shared.openai.responses import ModelCard
from worker.runtime import WorkerRuntime


class WorkerHelpers:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.served_model_names = (rt.settings.served_model_name,)
        self.max_request_bytes = rt.settings.max_request_bytes
        self.options = rt.settings.surface

    def check_client(self, request: Request) -> None:
        """The worker's API key, or the internal token routers send; needed when either is configured."""
        s = self.rt.settings
        if s.api_key is None and not s.internal_auth:
            return
        given = bearer_token(request).encode()
        accepted = [k for k in (s.api_key, s.admin_token if s.internal_auth else None) if k]
        if not any(hmac.compare_digest(given, k.encode()) for k in accepted):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")

    def card(self, name: str) -> ModelCard:
        engine = self.rt.engine.engine
        return ModelCard(id=name, owned_by="kimi-pd", root=engine.config.model, max_model_len=engine.max_model_len)

    async def tokenize(self, req: tokenize_api.TokenizeRequest) -> dict[str, Any]:
        rt = self.rt
        return await asyncio.to_thread(tokenize_api.tokenize, req, rt.tokenizer, rt.engine.engine.max_model_len,
                                       rt.model_config.vision_config, self.options)

    def detokenize(self, req: tokenize_api.DetokenizeRequest) -> dict[str, Any]:
        return tokenize_api.detokenize(req, self.rt.tokenizer)

    def tokenizer_info(self) -> dict[str, Any]:
        return tokenize_api.tokenizer_info(self.rt.tokenizer, self.rt.engine.engine.max_model_len)
