"""One prompt path: an OpenAI request with a data: URL (router and workers) and offline messages with
a PIL image (`LLM.render`) give the same token ids and image spans, without torch."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from engine.presets import tiny_config
from shared.errors import InvalidRequest
from shared.model_config import VisionConfig
from shared.openai.prompts import prepare_chat
from shared.openai.requests import ChatCompletionRequest
from shared.prompt.images import num_image_tokens
from shared.prompt.prepare import image_parts, render_prompt
from shared.prompt.tokenizer import KimiTokenizer


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.generated()


@pytest.fixture(scope="module")
def vision() -> VisionConfig:
    return VisionConfig.from_dict(tiny_config()["vision_config"])


def _image(seed: int, h: int = 50, w: int = 70) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _request(*urls: str, text: str = "what is in these?") -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return ChatCompletionRequest.model_validate({"model": "kimi-k3", "messages": [{"role": "user", "content": parts}]})


def test_request_with_data_urls_equals_offline_messages_with_pil_images(tok, vision) -> None:
    images = [_image(1), _image(2, 120, 40)]
    served = prepare_chat(_request(*map(_data_url, images)), tok, vision)
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                             {"type": "image", "image": images[1]},
                                             {"type": "text", "text": "what is in these?"}]}]
    offline = render_prompt(tok, messages, images, vision, thinking=True)
    assert served.token_ids == offline.token_ids
    assert served.image_spans() == offline.image_spans()
    assert [i.length for i in served.images] == [num_image_tokens(vision, im.height, im.width) for im in images]
    assert len(image_parts(messages)) == 2
    text = tok.decode(served.token_ids)    # vLLM 0.32's header: the upload's original width x height
    assert f"<|media_begin|>image {images[0].width}x{images[0].height}<|media_content|>" in text
    assert "<|media_begin|>image 40x120<|media_content|>" in text      # _image(h=120, w=40)
    other = prepare_chat(_request(_data_url(_image(3)), _data_url(images[1])), tok, vision)
    assert other.image_spans()[0].content_hash != served.image_spans()[0].content_hash   # other pixels, other key
    assert other.image_spans()[1] == served.image_spans()[1]


def test_images_refused_by_a_text_model_and_bad_urls_name_the_field(tok, vision) -> None:
    with pytest.raises(InvalidRequest, match="does not accept images") as info:
        prepare_chat(_request(_data_url(_image(1))), tok, None)
    assert info.value.param == "messages"
    for url in ("https://example.com/cat.png", "data:image/png;base64,bm90IGFuIGltYWdl"):
        with pytest.raises(InvalidRequest) as info:
            prepare_chat(_request(url), tok, vision)
        assert info.value.param == "messages" and "image_url" in info.value.message
