"""OpenAI chat/completion requests -> `PreparedPrompt` (the same on the router and on every worker)."""
from __future__ import annotations

import base64
import io
from typing import Any

from shared.errors import InvalidRequest
from shared.model_config import VisionConfig
from shared.openai.convert import chat_messages, image_urls, render_options
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.surface import SurfaceOptions
from shared.prompt.jinja_template import render_request_template
from shared.prompt.media_fetch import MediaFetchLimits
from shared.prompt.prepare import PreparedPrompt, decode_image_urls, image_url_bytes, is_remote, render_prompt
from shared.prompt.tokenizer import KimiTokenizer

_UNTRUSTED_TEMPLATE = ("chat_template: a chat template was sent with the request, but this server does not render "
                       "request templates (start it with --trust-request-chat-template)")


def prepare_chat(req: ChatCompletionRequest, tokenizer: KimiTokenizer, vision: VisionConfig | None,
                 options: SurfaceOptions | None = None) -> PreparedPrompt:
    options = options or SurfaceOptions()
    template = (req.model_extra or {}).get("chat_template")
    render = render_options(req)
    if template is not None:
        return _prepare_with_template(req, tokenizer, template, options, render)
    if vision is None and image_urls(req):
        raise InvalidRequest("this model does not accept images", param="messages")    # before fetching any
    inline_remote_images(req, options.media)
    images = decode_image_urls(image_urls(req), options.media)
    prepared = render_prompt(tokenizer, chat_messages(req), images, vision, **render)
    prepared.tools_requested = req.tools_requested
    prepared.cache_salt = req.cache_salt
    return prepared


def fetches_images(req: ChatCompletionRequest) -> bool:
    """Whether preparing `req` fetches an image URL (a blocking call: off the event loop)."""
    return any(is_remote(url) for url in image_urls(req))


def inline_remote_images(req: ChatCompletionRequest, limits: MediaFetchLimits) -> None:
    """Fetch each http(s) image of `req` once and put it back as a data: URL, so the body the router
    forwards carries the image itself: prefill and decode workers decode the bytes the router hashed."""
    for message in req.messages:
        for part in message.content if isinstance(message.content, list) else []:
            if part.image_url is not None and is_remote(part.image_url.url):
                try:
                    data = image_url_bytes(part.image_url.url, limits)
                except ValueError as exc:
                    raise InvalidRequest(f"image_url: {exc}", param="messages") from None
                part.image_url.url = f"data:image/{_format(data)};base64," + base64.b64encode(data).decode()


def _format(data: bytes) -> str:
    """The image's format for its data: URL (decoding sniffs it again; the name is for readers)."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as image:
            return (image.format or "unknown").lower()
    except Exception:          # noqa: BLE001 - not an image: decoding refuses it with the proper message
        return "unknown"


def _prepare_with_template(req: ChatCompletionRequest, tokenizer: KimiTokenizer, template: Any,
                           options: SurfaceOptions, render: dict[str, Any]) -> PreparedPrompt:
    """vLLM's request `chat_template`: rendered to text in a sandbox, then encoded as a text prompt (its
    special-token text is the special tokens). Only on a server that trusts request templates."""
    if not options.trust_request_chat_template:
        raise InvalidRequest(_UNTRUSTED_TEMPLATE, param="chat_template")
    if not isinstance(template, str) or not template:
        raise InvalidRequest("chat_template: must be a non-empty string", param="chat_template")
    if image_urls(req):
        raise InvalidRequest("chat_template: a request template cannot place images (their token count comes from "
                             "the model's vision config); send images without chat_template", param="chat_template")
    # thinking as the server reads it (chat_template_kwargs, reasoning_effort "none"), so the output parses
    thinking = {"thinking": render["thinking"], "enable_thinking": render["thinking"],
                "thinking_effort": render["thinking_effort"], "reasoning_effort": req.reasoning_effort}
    variables = {**(req.chat_template_kwargs or {}), **thinking, "messages": chat_messages(req),
                 "tools": render["tools"], "add_generation_prompt": True, "bos_token": tokenizer.bos_token,
                 "eos_token": tokenizer.eos_token}
    text = render_request_template(template, **variables)
    return PreparedPrompt(tokenizer.encode_prompt(text), thinking=render["thinking"],
                          tools_requested=req.tools_requested, cache_salt=req.cache_salt)


def prepare_completion(req: CompletionRequest, tokenizer: KimiTokenizer) -> PreparedPrompt:
    prompt = req.single_prompt
    ids = tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    return PreparedPrompt(ids, cache_salt=req.cache_salt)
