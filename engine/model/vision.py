"""Kimi-K3 vision: the MoonViT tower and the PatchMerger-v2 projector (docs/model.md, Vision).

The multimodal wrapper holds these as `vision_tower` and `mm_projector`. The parameter names below
are the same as the released K3 checkpoint's once those prefixes are added (D = vt_hidden_size,
Q = qkv_hidden_size, I = vt_intermediate_size, k = kh*kw merged patches, T = text_hidden_size):

    vision_tower.patch_embed.proj.weight             [D, 3, p, p]   conv patchify, bias-free
    vision_tower.patch_embed.pos_emb.weight          [H0, W0, D]    learnable 2D grid, resized bicubic
    vision_tower.encoder.blocks.{i}.norm0.weight     [D]            RMSNorm before attention
    vision_tower.encoder.blocks.{i}.wqkv.weight      [3Q, D]        packed q | k | v, heads of Q/heads
    vision_tower.encoder.blocks.{i}.wo.weight        [D, Q]
    vision_tower.encoder.blocks.{i}.norm1.weight     [D]            RMSNorm before the MLP
    vision_tower.encoder.blocks.{i}.mlp.fc0.weight   [I, D]         GELU-tanh in between
    vision_tower.encoder.blocks.{i}.mlp.fc1.weight   [D, I]
    vision_tower.encoder.final_layernorm.weight      [D]
    mm_projector.proj.0.weight                       [kD, kD]       vLLM renames it `linear_1`
    mm_projector.proj.2.weight                       [T, kD]        vLLM renames it `linear_2`
    mm_projector.post_norm.weight                    [T]
    mm_projector.rot_proj.weight                     [T, T]         ModelSlim/QuaRot checkpoints only

Sources (read, not copied):
* vllm-ascend/vllm-ascend-kimi-k3 `vllm_ascend/models/kimi_k3_vit.py` (the K3 tower and projector):
  bias-free conv and linears, `torch.nn.RMSNorm` with torch's default eps for norm0/norm1/
  final_layernorm, and `projector_ln_eps` for post_norm only. The position embedding is always resized
  bicubic: the reference model never reads the config's `pos_emb_interpolation_mode`. It also gives the
  head split of `qkv_hidden_size` and linear_1 -> GELU -> linear_2 -> post_norm.
  `transformers_utils/configs/kimi_k3.py` gives the config defaults. `models/kimi_k3.py` maps
  `mm_projector.proj.0/2 -> linear_1/2`. The same repository's `AscendKimiK3MultiModalProjector`
  defines rot_proj as a square bias-free linear applied after post_norm.
* vllm-project/vllm `kimi_k25_vit.py` and `moonvit.py` (Kimi-VL / K2.5 MoonViT): pre-norm blocks and
  the 2D RoPE layout. RoPE rotates adjacent channel pairs: pair 2i by the column index and pair 2i+1 by
  the row index, with frequency theta^(-4i/head_dim), theta = 10000, and a 512x512 grid at most. This
  follows the code; the docstring there says the opposite. They also give the merge order: a merged
  token concatenates its kh x kw patches row-major.
* Public K3 checkpoint-verification code lists the vision tensor names above, and a module-path table
  lists K3's `mm_projector.proj.{0,1,2}` and `post_norm`. We therefore keep the checkpoint's
  `nn.Sequential` names and expose `linear_1` / `linear_2` as aliases.

Simplifications:
* Images only (t = 1). We leave out the temporal sincos `time_weight` buffer (non-persistent, so it is
  not in the checkpoint) and temporal pooling. vLLM-Ascend serves K3 images only.
* Each image goes through the whole tower and projector on its own, with no packed varlen attention.
  Attention cannot cross images, and every kernel sees the same shapes whether an image comes alone or
  in a batch, so outputs do not depend on the batch on any device. A real image has thousands of patches,
  so its GEMMs already fill the device.
* The kh x kw merge happens in `MMProjector`. The reference does it at the end of the tower; this
  changes no tensor or name.
* RoPE uses real cos/sin arithmetic in fp32 rather than complex64. The math is the same, and complex
  dtypes are missing on some accelerators. The position-embedding resize also runs in fp32.
* No tensor parallelism or quantization.
* docs/model.md, Vision: RMSNorm and GELU-tanh in the tower. The projector's activation is exact GELU
  (`projector_hidden_act = "gelu"`). `VisionConfig` models the `vt_*` keys. We read the other K3 keys
  (`attn_bias`, `linear_bias`, `patch_embed_proj_bias`, `projector_ln_eps`, `norm_type`, ...) from
  `cfg.extra` with the K3 defaults, and reject any value we do not implement. `projector_ln_eps` falls
  back to `cfg.rms_norm_eps`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.gemm import Linear
from shared.model_config import ConfigError, VisionConfig
from shared.prompt.images import ROPE_MAX_GRID

ROPE_THETA = 10000.0

# K3 vision keys that VisionConfig does not model, with the only values this implementation runs.
_FIXED_EXTRAS: dict[str, tuple[Any, ...]] = {
    "norm_type": ("rmsnorm",),
    "activation_func": ("gelu_pytorch_tanh",),
    "projector_hidden_act": ("gelu",),
    "mlp_type": ("mlp2",),
    "pos_emb_type": ("divided_fixed",),
}


@dataclass(frozen=True)
class VisionOptions:
    """The K3 vision settings that live in `VisionConfig.extra` (real config keys, K3 defaults)."""

    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    projector_ln_eps: float = 1e-5


def vision_options(cfg: VisionConfig) -> VisionOptions:
    """Validate `cfg` for this implementation and return the extra K3 options it carries."""
    where = "vision_config"
    if cfg.merge_type != "sd2_tpool":
        raise ConfigError(f"{where}.merge_type: only 'sd2_tpool' is implemented, got {cfg.merge_type!r}")
    if cfg.mm_projector_type != "patchmergerv2":
        raise ConfigError(f"{where}.mm_projector_type: only 'patchmergerv2' is implemented, "
                          f"got {cfg.mm_projector_type!r}")
    if len(cfg.merge_kernel_size) != 2 or min(cfg.merge_kernel_size) < 1:
        raise ConfigError(f"{where}.merge_kernel_size: expected two positive ints, got {cfg.merge_kernel_size}")
    if cfg.qkv_hidden_size % cfg.vt_num_attention_heads:
        raise ConfigError(f"{where}.qkv_hidden_size {cfg.qkv_hidden_size} must divide by "
                          f"vt_num_attention_heads {cfg.vt_num_attention_heads}")
    head_dim = cfg.qkv_hidden_size // cfg.vt_num_attention_heads
    if head_dim % 4:
        raise ConfigError(f"{where}: 2D RoPE needs a head dim divisible by 4, got {head_dim}")
    extra = cfg.extra
    for key, allowed in _FIXED_EXTRAS.items():
        if key in extra and extra[key] not in allowed:
            raise ConfigError(f"{where}.{key}: only {allowed} is implemented, got {extra[key]!r}")
    mm_hidden = extra.get("mm_hidden_size")
    if mm_hidden is not None and mm_hidden != cfg.vt_hidden_size:
        raise ConfigError(f"{where}.mm_hidden_size {mm_hidden} must equal vt_hidden_size {cfg.vt_hidden_size}")
    return VisionOptions(
        attn_bias=bool(extra.get("attn_bias", False)),
        linear_bias=bool(extra.get("linear_bias", False)),
        patch_embed_proj_bias=bool(extra.get("patch_embed_proj_bias", False)),
        projector_ln_eps=float(extra.get("projector_ln_eps", cfg.rms_norm_eps)),
    )


# ---- 2D rotary embedding ------------------------------------------------------------------------

def rope_2d_cos_sin(height: int, width: int, head_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin `[height*width, head_dim//2]` for a row-major patch grid.

    Channel pair 2i turns by `column * f_i` and pair 2i+1 by `row * f_i`, f_i = theta^(-4i/head_dim).
    """
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device).float() / head_dim))
    rows = torch.arange(height, device=device).float().repeat_interleave(width)
    cols = torch.arange(width, device=device).float().repeat(height)
    angles = torch.stack((torch.outer(cols, freqs), torch.outer(rows, freqs)), dim=-1).flatten(1)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of `x [L, heads, head_dim]` in fp32; returns x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


# ---- tower ---------------------------------------------------------------------------------------

class PosEmb2D(nn.Module):
    """Learnable `[H0, W0, D]` position grid, resized bicubic to each image's patch grid."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        nn.init.normal_(self.weight)

    def forward(self, height: int, width: int) -> Tensor:
        if (height, width) == tuple(self.weight.shape[:2]):
            return self.weight
        grid = self.weight.float().permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(grid, size=(height, width), mode="bicubic", align_corners=False)
        return resized[0].permute(1, 2, 0).to(self.weight.dtype)


class PatchEmbed(nn.Module):
    """Non-overlapping p x p conv patchify plus the 2D position embedding."""

    def __init__(self, cfg: VisionConfig, bias: bool) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=bias)
        self.pos_emb = PosEmb2D(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """`[3, H, W]` -> `[H/p, W/p, D]`."""
        x = self.proj(pixel_values.unsqueeze(0))[0].permute(1, 2, 0)
        return x + self.pos_emb(x.shape[0], x.shape[1])


class MLP2(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc0 = Linear(dim, hidden, bias=bias)
        self.fc1 = Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    """Pre-norm block: x + Attn(norm0(x)), then x + MLP(norm1(x)). One image per call."""

    def __init__(self, cfg: VisionConfig, opts: VisionOptions) -> None:
        super().__init__()
        dim, qkv = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.num_heads = cfg.vt_num_attention_heads
        self.head_dim = qkv // self.num_heads
        # eps left at torch's default, as in the released K3 tower (only post_norm has an explicit eps).
        self.norm0 = nn.RMSNorm(dim)
        self.norm1 = nn.RMSNorm(dim)
        self.wqkv = Linear(dim, 3 * qkv, bias=opts.attn_bias)
        self.wo = Linear(qkv, dim, bias=opts.attn_bias)
        self.mlp = MLP2(dim, cfg.vt_intermediate_size, bias=opts.linear_bias)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.norm0(x), cos, sin)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig, opts: VisionOptions) -> None:
        super().__init__()
        self.head_dim = cfg.qkv_hidden_size // cfg.vt_num_attention_heads
        self.blocks = nn.ModuleList(EncoderBlock(cfg, opts) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = nn.RMSNorm(cfg.vt_hidden_size)

    def forward(self, x: Tensor, height: int, width: int) -> Tensor:
        """`x [height*width, D]` (row-major grid) -> same shape."""
        cos, sin = rope_2d_cos_sin(height, width, self.head_dim, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """MoonViT patch encoder: one normalised `[3, H, W]` image -> `[H/p, W/p, vt_hidden_size]`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        opts = vision_options(cfg)
        self.patch_size = cfg.patch_size
        self.merge_kernel_size = tuple(cfg.merge_kernel_size)
        self.patch_embed = PatchEmbed(cfg, bias=opts.patch_embed_proj_bias)
        self.encoder = Encoder(cfg, opts)

    def patch_grid(self, pixel_values: Tensor) -> tuple[int, int]:
        """Validated patch grid `(rows, cols)` of one preprocessed image."""
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 3 or pixel_values.shape[0] != 3:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, Tensor) else type(pixel_values).__name__
            raise ValueError(f"MoonViT expects one image as a [3, H, W] tensor, got {shape}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"MoonViT expects normalised float pixels (see preprocess_image), "
                             f"got dtype {pixel_values.dtype}")
        (_, height, width), (kh, kw) = pixel_values.shape, self.merge_kernel_size
        fh, fw = self.patch_size * kh, self.patch_size * kw
        if height == 0 or width == 0 or height % fh or width % fw:
            raise ValueError(f"image size {height}x{width} must be a positive multiple of "
                             f"{fh}x{fw} (patch_size x merge_kernel_size); use preprocess_image")
        rows, cols = height // self.patch_size, width // self.patch_size
        if max(rows, cols) > ROPE_MAX_GRID:
            raise ValueError(f"patch grid {rows}x{cols} exceeds the {ROPE_MAX_GRID} patches per side "
                             "MoonViT's 2D RoPE is defined for")
        return rows, cols

    def forward(self, pixel_values: Tensor) -> Tensor:
        rows, cols = self.patch_grid(pixel_values)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(device=weight.device, dtype=weight.dtype))
        x = self.encoder(x.reshape(rows * cols, -1), rows, cols)
        return x.view(rows, cols, -1)


# ---- projector -----------------------------------------------------------------------------------

class MMProjector(nn.Module):
    """PatchMerger v2: concatenate each kh x kw patch window -> linear_1 -> GELU -> linear_2 -> post_norm.

    `with_rot_proj` adds the ModelSlim output rotation (`rot_proj`, T x T), which QuaRot-rotated
    checkpoints carry. A plain K3 checkpoint has no such tensor.
    """

    def __init__(self, cfg: VisionConfig, with_rot_proj: bool = False) -> None:
        super().__init__()
        opts = vision_options(cfg)
        self.merge_kernel_size = tuple(cfg.merge_kernel_size)
        kh, kw = self.merge_kernel_size
        merged = cfg.vt_hidden_size * kh * kw
        self.proj = nn.Sequential(
            Linear(merged, merged, bias=False),
            nn.GELU(),
            Linear(merged, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=opts.projector_ln_eps)
        self.rot_proj = Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=False) if with_rot_proj else None

    @property
    def linear_1(self) -> nn.Linear:
        return _float_linear(self.proj[0])

    @property
    def linear_2(self) -> nn.Linear:
        return _float_linear(self.proj[2])

    def merge(self, features: Tensor) -> Tensor:
        """`[rows, cols, D]` -> `[rows/kh * cols/kw, kh*kw*D]`: window-major, row-major in each window."""
        if features.dim() != 3:
            raise ValueError(f"MMProjector expects a [rows, cols, D] patch grid, got {tuple(features.shape)}")
        (rows, cols, dim), (kh, kw) = features.shape, self.merge_kernel_size
        if rows % kh or cols % kw:
            raise ValueError(f"patch grid {rows}x{cols} does not divide into {kh}x{kw} merge windows")
        windows = features.reshape(rows // kh, kh, cols // kw, kw, dim).permute(0, 2, 1, 3, 4)
        return windows.reshape(-1, kh * kw * dim)

    def forward(self, features: Tensor) -> Tensor:
        weight = self.linear_1.weight
        x = self.merge(features.to(device=weight.device, dtype=weight.dtype))
        x = self.post_norm(self.proj(x))
        return x if self.rot_proj is None else self.rot_proj(x)


@torch.no_grad()
def encode_images(vision_tower: MoonViT, mm_projector: MMProjector, pixel_values: list[Tensor]) -> list[Tensor]:
    """Per image `[3, H, W]` -> `[num_image_tokens, text_hidden_size]`, in input order.

    Each image is encoded on its own, so a result never depends on the other images in the call.
    """
    if not isinstance(pixel_values, (list, tuple)):
        raise TypeError(f"encode_images expects a list of [3, H, W] tensors, got {type(pixel_values).__name__}")
    return [mm_projector(vision_tower(image)) for image in pixel_values]


def _float_linear(module: nn.Module) -> nn.Linear:
    """One of the projector's linears, which stay float: `forward` takes its input dtype and device
    from `linear_1.weight`."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"the vision projector's linears are float nn.Linear, got {type(module).__name__}")
    return module
