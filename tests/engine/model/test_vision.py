"""MoonViT tower, PatchMerger-v2 projector and image preprocessing (engine/model/vision.py,
engine/model/image_processing.py) on the tiny preset's vision config."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.image_processing import preprocess_image
from engine.model.vision import (
    MMProjector,
    MoonViT,
    apply_rope_2d,
    encode_images,
    rope_2d_cos_sin,
)
from engine.presets import tiny_config
from shared.model_config import ConfigError, VisionConfig
from shared.prompt.images import num_image_tokens, resized_size

# bf16 vs fp32 on the post_norm'd output (RMS ~1 per token): measured ~0.7% relative error.
BF16_REL_TOL = 2e-2
BF16_ABS_TOL = 0.1

# (height, width) of ORIGINAL images: tiny, non-multiples, over the pixel cap, extreme aspect ratios.
SIZES = [(1, 1), (13, 200), (28, 28), (224, 224), (300, 97), (500, 20), (1, 5000), (3000, 4000)]


@pytest.fixture(scope="module")
def cfg() -> VisionConfig:
    return VisionConfig.from_dict(tiny_config()["vision_config"])


@pytest.fixture(scope="module")
def model(cfg: VisionConfig) -> tuple[MoonViT, MMProjector]:
    torch.manual_seed(0)
    return MoonViT(cfg).eval(), MMProjector(cfg).eval()


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encode(model: tuple[MoonViT, MMProjector], images: list[torch.Tensor]) -> list[torch.Tensor]:
    return encode_images(model[0], model[1], images)


# ---- checkpoint names ----------------------------------------------------------------------------

def test_parameter_names_and_shapes_match_the_k3_checkpoint(cfg: VisionConfig) -> None:
    d, q, i = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size
    t, p = cfg.text_hidden_size, cfg.patch_size
    k = cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
    expected = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (cfg.init_pos_emb_height, cfg.init_pos_emb_width, d),
        "vision_tower.encoder.final_layernorm.weight": (d,),
        "mm_projector.proj.0.weight": (k * d, k * d),
        "mm_projector.proj.2.weight": (t, k * d),
        "mm_projector.post_norm.weight": (t,),
    }
    for layer in range(cfg.vt_num_hidden_layers):
        b = f"vision_tower.encoder.blocks.{layer}"
        expected |= {f"{b}.norm0.weight": (d,), f"{b}.norm1.weight": (d,), f"{b}.wqkv.weight": (3 * q, d),
                     f"{b}.wo.weight": (d, q), f"{b}.mlp.fc0.weight": (i, d), f"{b}.mlp.fc1.weight": (d, i)}
    wrapper = torch.nn.Module()
    wrapper.vision_tower, wrapper.mm_projector = MoonViT(cfg), MMProjector(cfg)
    assert {k: tuple(v.shape) for k, v in wrapper.state_dict().items()} == expected

    rotated = MMProjector(cfg, with_rot_proj=True)
    assert tuple(rotated.state_dict()["rot_proj.weight"].shape) == (t, t)
    assert rotated.linear_1 is rotated.proj[0] and rotated.linear_2 is rotated.proj[2]


def test_qkv_hidden_size_may_differ_from_hidden_size(cfg: VisionConfig) -> None:
    wide = dataclasses.replace(cfg, qkv_hidden_size=48)  # head_dim 24 != vt_hidden_size / heads
    torch.manual_seed(0)
    tower = MoonViT(wide)
    assert tuple(tower.encoder.blocks[0].wqkv.weight.shape) == (144, 32)
    assert tuple(tower.encoder.blocks[0].wo.weight.shape) == (32, 48)
    out = encode_images(tower, MMProjector(wide), [torch.randn(3, 56, 84)])[0]
    assert out.shape == (6, wide.text_hidden_size) and torch.isfinite(out).all()


# ---- token counts and preprocessing --------------------------------------------------------------

@pytest.mark.parametrize("height,width", SIZES)
def test_output_length_equals_num_image_tokens(cfg, model, height: int, width: int) -> None:
    pixels = preprocess_image(_pixels(height, width, seed=height + width), cfg)
    _, new_h, new_w = pixels.shape
    assert new_h % 28 == 0 and new_w % 28 == 0 and new_h * new_w <= cfg.max_image_pixels
    assert (new_h, new_w) == resized_size(cfg, height, width)
    out = _encode(model, [pixels])[0]
    assert out.shape == (num_image_tokens(cfg, height, width), cfg.text_hidden_size)
    assert torch.isfinite(out).all()


def test_preprocess_same_for_pil_numpy_and_torch(cfg: VisionConfig) -> None:
    array = _pixels(37, 61, seed=1)
    from_pil = preprocess_image(Image.fromarray(array), cfg)
    assert torch.equal(from_pil, preprocess_image(array, cfg))
    assert torch.equal(from_pil, preprocess_image(torch.from_numpy(array), cfg))
    gray = array[:, :, 0]
    assert torch.equal(preprocess_image(Image.fromarray(gray), cfg), preprocess_image(gray[:, :, None], cfg))
    rgba = np.concatenate([array, np.full((37, 61, 1), 7, np.uint8)], axis=2)
    assert torch.equal(preprocess_image(rgba, cfg), from_pil)   # alpha dropped


def test_preprocess_normalises_to_minus_one_one(cfg: VisionConfig) -> None:
    white = preprocess_image(np.full((56, 56, 3), 255, np.uint8), cfg)
    black = preprocess_image(np.zeros((56, 56, 3), np.uint8), cfg)
    assert white.dtype == torch.float32 and white.shape == (3, 56, 56)
    assert torch.equal(white, torch.ones_like(white)) and torch.equal(black, -torch.ones_like(black))
    red = preprocess_image(np.tile(np.array([255, 0, 0], np.uint8), (28, 28, 1)), cfg)
    assert red[0].eq(1).all() and red[1:].eq(-1).all()           # channel-first, RGB order


# ---- batching, isolation, determinism, dtypes ----------------------------------------------------

def test_batched_equals_individual(cfg, model) -> None:
    images = [preprocess_image(_pixels(h, w, seed=h), cfg) for h, w in [(50, 90), (112, 168), (1, 1), (300, 97)]]
    batched = _encode(model, images)
    for image, out in zip(images, batched, strict=False):
        assert torch.equal(out, _encode(model, [image])[0])


def test_attention_does_not_leak_across_images(model) -> None:
    torch.manual_seed(1)
    a, b = torch.randn(3, 112, 112), torch.randn(3, 56, 168)
    b_changed = b.clone()
    b_changed[:, :14, :14] += 5.0
    out_a = _encode(model, [a, b])[0]
    assert torch.equal(out_a, _encode(model, [a, b_changed])[0])
    # The same kind of edit inside one image does reach far-away tokens: attention mixes within an
    # image, so a cross-image leak would have shown up above.
    a_changed = a.clone()
    a_changed[:, :14, :14] += 5.0
    far_token = -1   # bottom-right merged token, patches nowhere near the edited one
    assert not torch.allclose(out_a[far_token], _encode(model, [a_changed, b])[0][far_token])


def test_deterministic(model) -> None:
    torch.manual_seed(2)
    image = torch.randn(3, 84, 140)
    assert torch.equal(_encode(model, [image])[0], _encode(model, [image])[0])


def test_bf16_close_to_fp32(model) -> None:
    torch.manual_seed(3)
    images = [torch.randn(3, 112, 168), torch.randn(3, 224, 224)]
    tower16, proj16 = copy.deepcopy(model[0]).bfloat16(), copy.deepcopy(model[1]).bfloat16()
    for ref, low in zip(_encode(model, images), encode_images(tower16, proj16, images), strict=False):
        assert low.dtype == torch.bfloat16 and low.shape == ref.shape
        err = ref - low.float()
        assert err.norm() / ref.norm() < BF16_REL_TOL
        assert err.abs().max() < BF16_ABS_TOL


# ---- merger and RoPE layout ----------------------------------------------------------------------

def _window_swap(grid: torch.Tensor, a: tuple[int, int], b: tuple[int, int]) -> torch.Tensor:
    out = grid.clone()
    out[a], out[b] = grid[b], grid[a]
    return out


def test_merger_concatenates_2x2_windows_row_major(cfg: VisionConfig) -> None:
    torch.manual_seed(4)
    proj = MMProjector(cfg)
    grid = torch.randn(4, 6, cfg.vt_hidden_size)            # 2 x 3 merged tokens
    # each token: patches (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1), concatenated in that order
    windows = [torch.cat([grid[2 * r + i, 2 * c + j] for i in range(2) for j in range(2)])
               for r in range(2) for c in range(3)]
    manual = proj.post_norm(proj.proj(torch.stack(windows)))
    torch.testing.assert_close(proj(grid), manual, rtol=0, atol=1e-6)


def test_merger_permutations_inside_vs_across_windows(cfg: VisionConfig) -> None:
    torch.manual_seed(5)
    proj = MMProjector(cfg)
    grid = torch.randn(4, 4, cfg.vt_hidden_size)            # tokens 0 1 / 2 3, each a 2x2 window
    base = proj(grid)

    def changed_tokens(other: torch.Tensor) -> set[int]:
        return {i for i in range(4) if not torch.allclose(base[i], proj(other)[i], atol=1e-6)}

    # inside window 0 (patches (0,0) and (1,1)): only token 0 changes
    assert changed_tokens(_window_swap(grid, (0, 0), (1, 1))) == {0}
    # one patch across windows 0 and 3: exactly those two tokens change
    assert changed_tokens(_window_swap(grid, (1, 1), (2, 2))) == {0, 3}
    # horizontal neighbours across the window border (0,1)<->(0,2): tokens 0 and 1
    assert changed_tokens(_window_swap(grid, (0, 1), (0, 2))) == {0, 1}
    # swapping whole windows 1 and 2 swaps their tokens and nothing else
    moved = grid.clone()
    moved[0:2, 2:4], moved[2:4, 0:2] = grid[2:4, 0:2], grid[0:2, 2:4]
    torch.testing.assert_close(proj(moved), base[[0, 2, 1, 3]], rtol=0, atol=1e-6)


def test_rope_2d_matches_complex_reference() -> None:
    h, w, heads, head_dim = 3, 5, 2, 16
    torch.manual_seed(6)
    x = torch.randn(h * w, heads, head_dim)
    cos, sin = rope_2d_cos_sin(h, w, head_dim, torch.device("cpu"))
    # Reference layout: complex pair 2i turns by column * f_i, pair 2i+1 by row * f_i.
    f = 10000.0 ** (-torch.arange(0, head_dim, 4).float() / head_dim)
    row, col = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    angle = torch.stack([col.reshape(-1, 1) * f, row.reshape(-1, 1) * f], dim=-1).reshape(h * w, -1)
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(h * w, heads, -1, 2))
                             * torch.polar(torch.ones_like(angle), angle)[:, None]).reshape_as(x)
    torch.testing.assert_close(apply_rope_2d(x, cos, sin), ref, rtol=1e-6, atol=1e-6)


def test_rope_2d_scores_depend_on_relative_position() -> None:
    torch.manual_seed(7)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    cos, sin = rope_2d_cos_sin(6, 6, 8, torch.device("cpu"))

    def score(pq: tuple[int, int], pk: tuple[int, int]) -> torch.Tensor:
        iq, ik = pq[0] * 6 + pq[1], pk[0] * 6 + pk[1]
        rq = apply_rope_2d(q, cos[iq:iq + 1], sin[iq:iq + 1])
        return (rq * apply_rope_2d(k, cos[ik:ik + 1], sin[ik:ik + 1])).sum()

    torch.testing.assert_close(score((1, 2), (3, 1)), score((3, 4), (5, 3)))
    assert not torch.allclose(score((1, 2), (3, 1)), score((1, 2), (1, 3)))


# ---- errors --------------------------------------------------------------------------------------

def test_encoder_input_errors(model) -> None:
    tower = model[0]
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        tower(torch.randn(1, 3, 28, 28))
    with pytest.raises(ValueError, match="multiple of 28x28"):
        tower(torch.randn(3, 30, 28))
    with pytest.raises(ValueError, match="normalised float"):
        tower(torch.zeros(3, 28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="512 patches"):
        tower(torch.zeros(3, 28, 14 * 514))
    with pytest.raises(TypeError, match="list"):
        encode_images(tower, model[1], torch.randn(3, 28, 28))
    with pytest.raises(ValueError, match="merge windows"):
        model[1](torch.randn(3, 4, 32))


def test_config_errors(cfg: VisionConfig) -> None:
    with pytest.raises(ConfigError, match="merge_type"):
        MoonViT(dataclasses.replace(cfg, merge_type="unpool"))
    with pytest.raises(ConfigError, match="mm_projector_type"):
        MMProjector(dataclasses.replace(cfg, mm_projector_type="patchmerger"))
    with pytest.raises(ConfigError, match="divisible by 4"):
        MoonViT(dataclasses.replace(cfg, qkv_hidden_size=36))
    with pytest.raises(ConfigError, match="norm_type"):
        MoonViT(dataclasses.replace(cfg, extra={"norm_type": "layernorm"}))
    with pytest.raises(ConfigError, match="max_image_pixels"):
        resized_size(dataclasses.replace(cfg, max_image_pixels=100), 10, 10)
    biased = MoonViT(dataclasses.replace(cfg, extra={"attn_bias": True, "projector_ln_eps": 1e-6}))
    assert biased.encoder.blocks[0].wqkv.bias is not None and biased.encoder.blocks[0].mlp.fc0.bias is None
    assert MMProjector(dataclasses.replace(cfg, extra={"projector_ln_eps": 1e-6})).post_norm.eps == 1e-6


def test_preprocess_errors(cfg: VisionConfig) -> None:
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(np.zeros((8, 8, 3), np.float32), cfg)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(torch.zeros(8, 8, 3), cfg)
    with pytest.raises(ValueError, match="channels"):
        preprocess_image(np.zeros((8, 8, 2), np.uint8), cfg)
    with pytest.raises(ValueError, match="channels"):
        preprocess_image(np.zeros((0, 8, 3), np.uint8), cfg)
    with pytest.raises(TypeError, match="PIL image"):
        preprocess_image([[0, 0, 0]], cfg)
    with pytest.raises(ValueError, match="positive ints"):
        num_image_tokens(cfg, 0, 10)
    with pytest.raises(ValueError, match="positive ints"):
        num_image_tokens(cfg, 10.5, 10)
    assert num_image_tokens(cfg, np.int64(300), np.int32(97)) == num_image_tokens(cfg, 300, 97)
