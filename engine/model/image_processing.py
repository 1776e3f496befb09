"""Image decoding and MoonViT preprocessing for Kimi-K3.

`preprocess_image` turns decoded pixels into the `[3, H, W]` float tensor that `MoonViT` takes.
`num_image_tokens` tells the prompt builder how many `<|media_pad|>` tokens an image of a given
original size expands to. Both use `resized_size`, so the count always equals the encoder's output
length.

Sources and deviations:
* Normalisation: `(x / 255 - 0.5) / 0.5` per channel, which puts pixels in [-1, 1]. The mean and std
  are 0.5, as in the `media_proc_cfg` of Kimi-K2.5/K3 `preprocessor_config.json` (Moonshot's
  `KimiK25VisionProcessor` and the K3 processor fixtures in vllm-ascend-kimi-k3). Kimi-VL's image-processor
  class declares CLIP constants as constructor defaults, but the K3 family does not use them.
* Resampling: PIL bicubic, as in `navit_resize_image` / `image_to_np` of the K2.5 processor.
* Sizing differs from the real processor. That processor scales by `in_patch_limit` (65536 patches for
  K3) and `patch_limit_on_one_side` (512), then zero-pads up to a multiple of patch_size * merge. Here
  we resize straight to such a multiple (aspect kept up to rounding) under the config's
  `max_image_pixels`. We cap each side at the 512 patches the 2D RoPE is defined for. A tiny image is
  upscaled to one merged token. No padding reaches the encoder.
* Video and EXIF orientation are not handled.
"""
from __future__ import annotations

import io
import math
import operator
import os
from pathlib import Path
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from engine.config import ConfigError, VisionConfig
from engine.model.vision import ROPE_MAX_GRID

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)

# load_image limits: encoded size, and decoded pixels (checked from the header, before decoding).
MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_DECODED_PIXELS = 64 * 1024 * 1024

ImageInput = Image.Image | np.ndarray | Tensor


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


def to_rgb(image: ImageInput) -> Image.Image:
    """A PIL RGB image from a PIL image or decoded uint8 pixels (HW, HWC with C in 1/3/4)."""
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, Tensor):
        if image.dtype != torch.uint8:
            raise ValueError(f"image tensor must be uint8 HWC pixels, got dtype {image.dtype}")
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(f"expected a PIL image, numpy array or torch tensor, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ValueError(f"image array must be uint8 HWC pixels, got dtype {image.dtype}")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (3, 4))) or 0 in image.shape:
        raise ValueError(f"image array must be HW or HWC with 1, 3 or 4 channels, got shape {image.shape}")
    return Image.fromarray(np.ascontiguousarray(image)).convert("RGB")


def preprocess_image(image: ImageInput, cfg: VisionConfig) -> Tensor:
    """Decoded image -> normalised fp32 `[3, H, W]`, sized by `resized_size` for MoonViT."""
    rgb = to_rgb(image)
    width, height = rgb.size
    new_h, new_w = resized_size(cfg, height, width)
    if (new_w, new_h) != rgb.size:
        rgb = rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0)
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    return ((pixels - mean) / std).permute(2, 0, 1).contiguous()


def load_image(source: str | os.PathLike[str] | bytes | bytearray | memoryview, *,
               max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_DECODED_PIXELS) -> Image.Image:
    """Decode an image file or encoded bytes to PIL RGB.

    Raises ValueError for input that is empty, too large or undecodable. The pixel limit is checked
    against the header before decoding, so a decompression bomb never allocates its pixels.
    """
    data = _read_source(source, max_bytes)
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"could not decode image ({len(data)} bytes): {exc}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, over the {max_pixels} limit")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ValueError(f"could not decode image ({width}x{height}, {len(data)} bytes): {exc}") from exc


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
