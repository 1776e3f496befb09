"""OpenAI chat/completion requests -> `PreparedPrompt` (the same on the router and on every worker)."""
from __future__ import annotations

from shared.model_config import VisionConfig
from shared.openai.convert import chat_messages, image_urls, render_options
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.prompt.prepare import PreparedPrompt, decode_image_url, render_prompt
from shared.prompt.tokenizer import KimiTokenizer


def prepare_chat(req: ChatCompletionRequest, tokenizer: KimiTokenizer, vision: VisionConfig | None) -> PreparedPrompt:
    options = render_options(req)
    images = [decode_image_url(url) for url in image_urls(req)]
    prepared = render_prompt(tokenizer, chat_messages(req), images, vision, **options)
    prepared.tools_requested = req.tools_requested
    return prepared


def prepare_completion(req: CompletionRequest, tokenizer: KimiTokenizer) -> PreparedPrompt:
    ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return PreparedPrompt(ids)
