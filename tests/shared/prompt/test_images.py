"""Image sizing and decoding for prompts (`shared.prompt.images`, torch-free); that the encoder's output
length equals `num_image_tokens` is checked with the tower in tests/engine/test_vision.py."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from engine.presets import tiny_config
from shared.errors import InvalidRequest
from shared.model_config import VisionConfig
from shared.prompt.images import declared_pixels, load_image, load_images, num_image_tokens, resized_size
from shared.prompt.prepare import decode_image_urls


@pytest.fixture(scope="module")
def cfg() -> VisionConfig:
    return VisionConfig.from_dict(tiny_config()["vision_config"])


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_resize_keeps_aspect_and_caps_pixels(cfg: VisionConfig) -> None:
    assert resized_size(cfg, 1, 1) == (28, 28)          # upscaled to one merged token
    assert resized_size(cfg, 224, 224) == (224, 224)    # already valid: untouched
    assert resized_size(cfg, 448, 448) == (224, 224)    # over the cap: halved
    for height, width in [(448, 224), (3000, 4000), (1080, 1920), (700, 333)]:
        h, w = resized_size(cfg, height, width)
        assert h * w <= cfg.max_image_pixels and h * w > cfg.max_image_pixels / 2
        assert abs((h / w) / (height / width) - 1) < 0.2, (height, width, h, w)  # 28-px cells
    assert num_image_tokens(cfg, 1, 5000) == cfg.max_image_pixels // (28 * 28)


# ---- load_image ----------------------------------------------------------------------------------

def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_load_image_decodes_bytes_and_paths(tmp_path) -> None:
    array = _pixels(20, 30, seed=8)
    data = _png(array)
    assert np.array_equal(np.asarray(load_image(data)), array)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    image = load_image(path)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), array)
    assert load_image(_png(array[:, :, 0])).mode == "RGB"   # grayscale file -> RGB


def test_load_image_errors(tmp_path) -> None:
    data = _png(_pixels(20, 30, seed=9))
    with pytest.raises(ValueError, match="could not decode"):
        load_image(b"definitely not an image")
    with pytest.raises(ValueError, match="could not decode"):
        load_image(data[: len(data) // 2])                  # truncated PNG
    with pytest.raises(ValueError, match="empty"):
        load_image(b"")
    with pytest.raises(ValueError, match="byte limit"):
        load_image(data, max_bytes=100)
    big = tmp_path / "big.png"
    big.write_bytes(data)
    with pytest.raises(ValueError, match="byte limit"):
        load_image(big, max_bytes=100)
    with pytest.raises(ValueError, match="pixels, over"):
        load_image(data, max_pixels=20 * 30 - 1)
    with pytest.raises(TypeError, match="path or bytes"):
        load_image(12345)


def _solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_one_requests_images_are_bounded_in_total_before_any_is_decoded(monkeypatch) -> None:
    images = [_solid_png(100, 100)] * 3                                 # 30,000 pixels in all
    assert [im.size for im in load_images(images, max_total_pixels=30_000)] == [(100, 100)] * 3
    decoded = []
    monkeypatch.setattr("shared.prompt.images.load_image", lambda data: decoded.append(data))
    with pytest.raises(ValueError, match="3 images have 30000 pixels in all, over the 29999-pixel limit"):
        load_images(images, max_total_pixels=29_999)
    assert decoded == []                                          # refused from the headers alone


def test_declared_pixels_reads_the_header_only() -> None:
    assert declared_pixels(_solid_png(64, 48)) == 64 * 48
    assert declared_pixels(b"not an image") == 0


def test_twenty_images_at_the_per_image_cap_are_a_400_naming_the_limit() -> None:
    url = "data:image/png;base64," + base64.b64encode(_solid_png(4096, 4096)).decode()   # 16 Mpx each
    with pytest.raises(InvalidRequest, match="20 images have 335544320 pixels in all") as err:
        decode_image_urls([url] * 20)
    assert err.value.param == "messages"
    assert len(decode_image_urls([url] * 4)) == 4                 # the default allows four at the cap
