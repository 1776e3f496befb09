"""Messages or an OpenAI request -> prompt token ids (+ placed images), identical on the router, on
every worker and in the offline `LLM`.

The router hashes what this returns to place the request; the worker computes exactly the same ids,
so prefix hashes agree. Images come as data: URLs or http(s) URLs (`media_fetch`, within the server's
limits; the router sends the fetched image on inlined, so every server of a request sees the same bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from shared.errors import InvalidRequest
from shared.hashing import ImageSpan
from shared.model_config import VisionConfig
from shared.prompt.chat import render_chat
from shared.prompt.images import content_hash, data_url_bytes, load_images, num_image_tokens
from shared.prompt.media_fetch import MediaFetchLimits, fetch_url_bytes
from shared.prompt.tokenizer import KimiTokenizer


@dataclass
class ImageItem:
    """A decoded image placed at a `<|media_pad|>` run of `length` tokens starting at `start`."""

    start: int
    length: int
    image: Any                                   # PIL.Image (RGB)


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    images: list[ImageItem] = field(default_factory=list)
    thinking: bool = False
    tools_requested: bool = False
    cache_salt: str | None = None        # salts the prefix hashes (router placement and engine cache)

    def image_spans(self) -> list[ImageSpan]:
        return [ImageSpan(i.start, i.length, content_hash(i.image)) for i in self.images]


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def image_url_bytes(url: str, limits: MediaFetchLimits | None = None) -> bytes:
    """The encoded image of a data: URL, or fetched from an http(s) URL within `limits`."""
    return fetch_url_bytes(url, limits or MediaFetchLimits()) if is_remote(url) else data_url_bytes(url)


def decode_image_urls(urls: list[str], limits: MediaFetchLimits | None = None) -> list[Image.Image]:
    """One request's images, decoded within the per-image and per-request pixel limits; a bad one is a 400."""
    try:
        return load_images([image_url_bytes(url, limits) for url in urls])
    except ValueError as exc:
        raise InvalidRequest(f"image_url: {exc}", param="messages") from None


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image content parts of `messages`, in prompt order (the order `render_chat` places them)."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") in ("image", "image_url")]


def render_prompt(tokenizer: KimiTokenizer, messages: list[dict[str, Any]], images: list[Image.Image],
                  vision: VisionConfig | None, **render_options: Any) -> PreparedPrompt:
    """Render a conversation whose image parts are `images` (decoded, in prompt order)."""
    counts = sizes = None
    if images:
        if vision is None:
            raise InvalidRequest("this model does not accept images", param="messages")
        counts = [num_image_tokens(vision, img.height, img.width) for img in images]
        sizes = [(img.width, img.height) for img in images]      # the header names the original size
    rendered = render_chat(tokenizer, messages, image_token_counts=counts, image_sizes=sizes, **render_options)
    items = [ImageItem(start, n, img) for (start, n), img in zip(rendered.image_spans, images, strict=False)]
    return PreparedPrompt(rendered.token_ids, items, thinking=bool(render_options.get("thinking")))
