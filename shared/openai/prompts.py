"""OpenAI chat/completion requests -> `PreparedPrompt` (the same on the router and on every worker)."""
from __future__ import annotations

from shared.model_config import VisionConfig
from shared.openai.convert import chat_messages, image_urls, render_options
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.prompt.prepare import PreparedPrompt, decode_image_urls, render_prompt
from shared.prompt.tokenizer import KimiTokenizer


def prepare_chat(req: ChatCompletionRequest, tokenizer: KimiTokenizer, vision: VisionConfig | None) -> PreparedPrompt:
    options = render_options(req)
    images = decode_image_urls(image_urls(req))
    prepared = render_prompt(tokenizer, chat_messages(req), images, vision, **options)
    prepared.tools_requested = req.tools_requested
    prepared.cache_salt = req.cache_salt
    return prepared


def prepare_completion(req: CompletionRequest, tokenizer: KimiTokenizer) -> PreparedPrompt:
    prompt = req.single_prompt
    ids = tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    return PreparedPrompt(ids, cache_salt=req.cache_salt)
