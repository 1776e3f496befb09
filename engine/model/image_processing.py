"""MoonViT preprocessing for Kimi-K3 (decoding and sizing, torch-free, are in `shared.prompt.images`).

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

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from shared.model_config import VisionConfig
from shared.prompt.images import resized_size

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)

ImageInput = Image.Image | np.ndarray | Tensor


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
