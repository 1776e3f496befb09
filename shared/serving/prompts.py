"""OpenAI request -> prompt token ids (+ images), identical on the router and on every worker.

The router hashes what this returns to place the request; the worker computes exactly the same ids,
so prefix hashes agree. Only data: URLs are accepted for images (the workers fetch nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ModelConfig
from engine.core.inputs import EngineInput, ImageItem, content_hash_of
from engine.errors import InvalidRequest
from engine.tokenizer.chat import render_chat
from engine.tokenizer.tokenizer import KimiTokenizer
from shared.hashing import ImageSpan
from shared.openai.convert import chat_messages, image_urls, render_options
from shared.openai.requests import ChatCompletionRequest, CompletionRequest


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    images: list[ImageItem] = field(default_factory=list)
    thinking: bool = False
    tools_requested: bool = False

    def engine_input(self) -> EngineInput:
        return EngineInput(self.token_ids, self.images)

    def image_spans(self) -> list[ImageSpan]:
        return [ImageSpan(i.start, i.length, content_hash_of(i.image)) for i in self.images]


def decode_image_url(url: str):
    from engine.llm import decode_image_part
    try:
        return decode_image_part({"type": "image_url", "image_url": {"url": url}})
    except ValueError as exc:
        raise InvalidRequest(f"image_url: {exc}", param="messages") from exc


def prepare_chat(req: ChatCompletionRequest, tokenizer: KimiTokenizer, config: ModelConfig) -> PreparedPrompt:
    options = render_options(req)
    images = [decode_image_url(url) for url in image_urls(req)]
    counts = None
    if images:
        if config.vision_config is None:
            raise InvalidRequest("this model does not accept images", param="messages")
        from engine.model.image_processing import num_image_tokens
        counts = [num_image_tokens(config.vision_config, img.height, img.width) for img in images]
    rendered = render_chat(tokenizer, chat_messages(req), image_token_counts=counts, **options)
    items = [ImageItem(start, n, img) for (start, n), img in zip(rendered.image_spans, images)]
    return PreparedPrompt(rendered.token_ids, items, thinking=options["thinking"], tools_requested=req.tools_requested)


def prepare_completion(req: CompletionRequest, tokenizer: KimiTokenizer) -> PreparedPrompt:
    ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return PreparedPrompt(ids)
