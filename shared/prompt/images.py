"""Images in prompts, torch-free (the router places image requests without loading the engine).

`num_image_tokens` tells the prompt builder how many `<|media_pad|>` tokens an image of a given
original size expands to; `resized_size` is the size `engine.model.image_processing.preprocess_image`
resizes it to, so the count always equals the encoder's output length (sizing notes there).
`load_image` decodes bounded input; `decode_image_part` reads an OpenAI content part (a data: URL, or an
http(s) URL fetched within `media_fetch`'s default limits); `content_hash` is what prefix hashing keys an
image by.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import operator
import os
import re
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from shared.hashing import image_content_hash
from shared.model_config import ConfigError, VisionConfig

_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")

# The reference precomputes MoonViT's 2D RoPE for a 512 x 512 patch grid: larger grids have no defined model.
ROPE_MAX_GRID = 512

# load_image limits: encoded size, and decoded pixels (checked from the header, before decoding).
MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_DECODED_PIXELS = 16 * 1024 * 1024      # a 16 Mpx photo; every image is resized to max_image_pixels anyway
MAX_REQUEST_PIXELS = 4 * MAX_DECODED_PIXELS  # all of one request's images: bounds what one request decodes at once


def resized_size(cfg: VisionConfig, height: int, width: int) -> tuple[int, int]:
    """`(H, W)` that `preprocess_image` resizes a `height x width` image to.

    Both sides are multiples of patch_size * merge_kernel_size, H*W <= max_image_pixels, each side is
    at most ROPE_MAX_GRID patches, and there is at least one merged token.
    """
    try:
        h, w = operator.index(height), operator.index(width)   # int-like, numpy ints too
    except TypeError:
        h = w = 0
    if h <= 0 or w <= 0:
        raise ValueError(f"image size must be two positive ints, got {height!r}x{width!r}")
    height, width = h, w
    kh, kw = cfg.merge_kernel_size
    fh, fw = cfg.patch_size * kh, cfg.patch_size * kw
    max_pixels = cfg.max_image_pixels
    if max_pixels < fh * fw:
        raise ConfigError(f"vision_config.max_image_pixels {max_pixels} is below one merged token ({fh}x{fw})")
    scale = min(1.0, math.sqrt(max_pixels / (height * width)))
    cells_h = min(ROPE_MAX_GRID // kh, max(1, math.floor(height * scale / fh + 0.5)))
    cells_w = min(ROPE_MAX_GRID // kw, max(1, math.floor(width * scale / fw + 0.5)))
    target_aspect = math.log(height / width)

    def aspect_error(cells: tuple[int, int]) -> float:
        return abs(math.log(cells[0] * fh / (cells[1] * fw)) - target_aspect)

    while cells_h * fh * cells_w * fw > max_pixels:  # rounding up overshot: drop the row or column
        options = []
        if cells_h > 1:
            options.append((cells_h - 1, cells_w))
        if cells_w > 1:
            options.append((cells_h, cells_w - 1))
        cells_h, cells_w = min(options, key=aspect_error)  # the one that distorts the aspect least
    return cells_h * fh, cells_w * fw


def num_image_tokens(cfg: VisionConfig, height: int, width: int) -> int:
    """Number of image tokens (`<|media_pad|>` expansions) for an image of this ORIGINAL size."""
    new_h, new_w = resized_size(cfg, height, width)
    kh, kw = cfg.merge_kernel_size
    return (new_h // (cfg.patch_size * kh)) * (new_w // (cfg.patch_size * kw))


def load_image(source: str | os.PathLike[str] | bytes | bytearray | memoryview, *,
               max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_DECODED_PIXELS) -> Image.Image:
    """Decode an image file or encoded bytes to PIL RGB.

    Raises ValueError for input that is empty, too large or undecodable. The pixel limit is checked
    against the header before decoding, so a decompression bomb never allocates its pixels.
    """
    data = _read_source(source, max_bytes)
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError(f"could not decode image ({len(data)} bytes): not an image format this server reads "
                         "(PNG, JPEG, GIF, WebP, BMP, ...)") from None
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"could not decode image ({len(data)} bytes): {_reason(exc)}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, over the {max_pixels} limit")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ValueError(f"could not decode image ({width}x{height}, {len(data)} bytes): {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """What went wrong, in words a client can read: PIL's messages may carry an object's repr, which says
    nothing to a client and something about the server."""
    return _REPR.sub("the image data", str(exc)) or type(exc).__name__


def _read_source(source: str | os.PathLike[str] | bytes | bytearray | memoryview, max_bytes: int) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        size = path.stat().st_size
        if size > max_bytes:
            raise ValueError(f"image file {path} is {size} bytes, over the {max_bytes}-byte limit")
        data = path.read_bytes()
    else:
        raise TypeError(f"load_image expects a path or bytes, got {type(source).__name__}")
    if not data:
        raise ValueError("image data is empty")
    if len(data) > max_bytes:
        raise ValueError(f"image is {len(data)} bytes, over the {max_bytes}-byte limit")
    return data


def decode_image_part(part: dict[str, Any]) -> Image.Image:
    """A PIL image from an OpenAI content part: {"type": "image", "image": PIL} or a data: URL."""
    if part.get("type") == "image" and "image" in part:
        return part["image"]
    image_url = part.get("image_url")
    url = image_url.get("url", "") if isinstance(image_url, dict) else part.get("image_url", "")
    if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
        from shared.prompt.media_fetch import MediaFetchLimits, fetch_url_bytes
        return load_image(fetch_url_bytes(url, MediaFetchLimits()))
    return load_image(data_url_bytes(url))


def data_url_bytes(url: object) -> bytes:
    """The encoded image of a base64 data: URL (http(s) URLs are `media_fetch`'s)."""
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ValueError("images must be given as data: URLs with base64 content or as http(s) URLs")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"the data: URL is not valid base64 ({exc})") from None


def declared_pixels(data: bytes) -> int:
    """Width x height as the encoded image's header declares them, without decoding its pixels (0 when
    the header cannot be read: decoding then fails with the proper message)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError):
        return 0
    return width * height


def load_images(encoded: list[bytes], max_total_pixels: int = MAX_REQUEST_PIXELS) -> list[Image.Image]:
    """Decode one request's images, after checking from their headers alone that together they stay
    within `max_total_pixels` (20 images at the per-image cap would otherwise take ~1 GB at once)."""
    total = sum(declared_pixels(data) for data in encoded)
    if total > max_total_pixels:
        raise ValueError(f"the request's {len(encoded)} images have {total} pixels in all, over the "
                         f"{max_total_pixels}-pixel limit for one request")
    return [load_image(data) for data in encoded]


def content_hash(image: Image.Image) -> bytes:
    """The image's identity for prefix hashing: its RGB pixels and size."""
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    return image_content_hash(rgb.tobytes(), rgb.width, rgb.height)
