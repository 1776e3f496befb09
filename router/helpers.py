"""The router's side of the shared OpenAI helper endpoints (shared/openai/helpers.py): client API keys,
every served name (aliases too), and the prompt source's tokenizer (K3's, a Hugging Face one, or none)."""
from __future__ import annotations

import asyncio
from typing import Any, cast

from fastapi import Request

from router.admission.tenants import Tenant, Tenants
from router.prompt_source import PromptSource, foreign_detokenize, foreign_tokenize
from router.settings import RouterSettings
from shared.http import bearer_token
from shared.openai import tokenize as tokenize_api
from shared.openai.errors import Unauthorized
from shared.openai.responses import ModelCard


class RouterHelpers:
    def __init__(self, settings: RouterSettings, prompts: PromptSource, tenants: Tenants) -> None:
        self.settings, self.prompts, self.tenants = settings, prompts, tenants
        self.served_model_names = settings.served_model_names
        self.max_request_bytes = settings.max_request_bytes
        self.options = settings.surface
        # K3's own tokenizer serves /tokenize; an HF one (or none) goes through the prompt source
        self.tokenizer = cast(Any, prompts).tokenizer if prompts.kind == "kimi-k3" else None
        self.max_model_len = prompts.max_model_len

    def check_client(self, request: Request) -> Tenant:
        """The request's tenant (docs/admission.md); 401 for a key that is none of the fleet's."""
        tenants = self.tenants
        if tenants.open_to_all():                    # skip reading the header: nothing to compare it with
            return tenants.default
        tenant = tenants.resolve(bearer_token(request))
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, owned_by="kimi-pd", root=self.settings.model or self.settings.served_model_name,
                         max_model_len=self.max_model_len)

    async def tokenize(self, req: tokenize_api.TokenizeRequest) -> dict[str, Any]:
        if self.tokenizer is None:                       # an HF tokenizer, or none (text mode refuses)
            return foreign_tokenize(self.prompts, req)
        # off the event loop: messages may hold image URLs to fetch
        return await asyncio.to_thread(tokenize_api.tokenize, req, self.tokenizer, self.max_model_len,
                                       self.prompts.vision_config, self.options)

    def detokenize(self, req: tokenize_api.DetokenizeRequest) -> dict[str, Any]:
        if self.tokenizer is None:
            return foreign_detokenize(self.prompts, req)
        return tokenize_api.detokenize(req, self.tokenizer)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.prompts.tokenizer_info()
