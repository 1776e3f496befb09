"""`/tokenize`, `/detokenize`, `/tokenizer_info` in vLLM's shapes (lm-eval's remote tokenizer and
benchmark tools probe them). Pure functions over the project's tokenizer, served the same by the
router and every worker, so a client tokenizes exactly as the serving path does: a `prompt` as
/v1/completions encodes it, `messages` as /v1/chat/completions renders them.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.errors import InvalidRequest
from shared.model_config import VisionConfig
from shared.openai.base import Bool, Int, RequestModel
from shared.openai.messages import ChatMessage
from shared.openai.requests import ChatCompletionRequest
from shared.openai.surface import SurfaceOptions
from shared.prompt.tokenizer import KimiTokenizer


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True             # K3's tokenizer adds no BOS/EOS: either value gives the same ids
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Int] = Field(default_factory=list)


def tokenize(req: TokenizeRequest, tokenizer: KimiTokenizer, max_model_len: int,
             vision: VisionConfig | None, options: SurfaceOptions | None = None) -> dict[str, Any]:
    """`{count, max_model_len, tokens, token_strs}`; exactly one of `prompt` and `messages`."""
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = tokenizer.encode_prompt(req.prompt)
    else:
        if not req.add_generation_prompt:
            raise InvalidRequest("add_generation_prompt: false is not supported (the K3 template always opens "
                                 "the assistant turn)", param="add_generation_prompt")
        from shared.openai.prompts import prepare_chat
        chat = ChatCompletionRequest.model_validate({
            "messages": [m.model_dump(mode="json", exclude_none=True) for m in req.messages or []],
            "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs})
        ids = prepare_chat(chat, tokenizer, vision, options).token_ids
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [tokenizer.decode([i]) for i in ids] if req.return_token_strs else None}


def detokenize(req: DetokenizeRequest, tokenizer: KimiTokenizer) -> dict[str, Any]:
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"tokens: ids must be in [0, {tokenizer.vocab_size}), got {bad[:8]}", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def tokenizer_info(tokenizer: KimiTokenizer, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's config (special tokens, class, lengths) and the chat template
    (the checkpoint's, else the Jinja twin of the renderer), so a client applying it renders our prompts."""
    from shared.prompt.hf_files import CHAT_TEMPLATE
    return {"tokenizer_class": "TikTokenTokenizer", "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "model_max_length": max_model_len, "vocab_size": tokenizer.vocab_size,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "chat_template": tokenizer.chat_template or CHAT_TEMPLATE}
