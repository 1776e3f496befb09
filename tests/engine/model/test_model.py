"""Whole model: full prefill == chunked prefill == token-by-token decode; batched == single."""
from __future__ import annotations

import pytest
import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.sequence_runner import SequenceRunner
from tests.engine.conftest import tiny_model

FP32_REL_TOL = 1e-5     # max |diff| / max |logit|; fp32 rounding differs between the kernel forms


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def feed_in_pieces(model, ids, pieces) -> torch.Tensor:
    runner, outs, done = SequenceRunner(model, 128), [], 0
    for n in pieces:
        outs.append(runner.feed(ids[done:done + n]))
        done += n
    assert done == ids.numel()
    return torch.cat(outs)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_equals_chunks_equals_decode_fp32(seed):
    model = tiny_model(seed=seed)
    ids = prompt(32, seed)
    full = feed_in_pieces(model, ids, [32])
    chunks = feed_in_pieces(model, ids, [11, 5, 16])
    decode = feed_in_pieces(model, ids, [1] * 32)
    mixed = feed_in_pieces(model, ids, [11, 5, 1, 1, 1, 13])
    for other in (chunks, decode, mixed):
        assert relative_error(other, full) <= FP32_REL_TOL


def test_prefill_equals_decode_fp64_exactly():
    model = tiny_model(dtype=torch.float64)
    ids = prompt(24, 3)
    full = feed_in_pieces(model, ids, [24])
    torch.testing.assert_close(feed_in_pieces(model, ids, [1] * 24), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(feed_in_pieces(model, ids, [9, 15]), full, rtol=0, atol=1e-10)


def test_logits_depend_on_context():
    """Guards the equivalences above: a model that ignored context would pass them trivially."""
    model = tiny_model()
    ids = prompt(32, 0)
    changed = ids.clone()
    changed[0] = (changed[0] + 1) % 1024
    last = feed_in_pieces(model, ids, [32])[-1]
    assert relative_error(feed_in_pieces(model, changed, [32])[-1], last) > 1e-3


def test_batched_forward_equals_each_sequence_alone():
    model = tiny_model(dtype=torch.float64)
    cfg = model.config.text_config
    prompts = [prompt(n, 10 + n) for n in (5, 12, 1, 9)]
    alone = [feed_in_pieces(model, p, [p.numel()]) for p in prompts]
    cache = HybridCacheTensors.allocate(cfg, num_blocks=16, num_slots=4, block_size=4, dtype=torch.float64)
    tables = [torch.tensor([4 * i + j for j in range(4)]) for i in range(4)]
    slices = [SequenceSlice(p.numel(), 0, i, tables[i], reset_kda_state=True) for i, p in enumerate(prompts)]
    logits = model(torch.cat(prompts), ForwardBatch(slices, cache))
    torch.testing.assert_close(logits, torch.cat(alone), rtol=0, atol=1e-10)
    # then one decode step for all four together == each alone
    nxt = [prompt(1, 99 + i) for i in range(4)]
    step_slices = [SequenceSlice(1, p.numel(), i, tables[i]) for i, p in enumerate(prompts)]
    step = model(torch.cat(nxt), ForwardBatch(step_slices, cache))
    for i, p in enumerate(prompts):
        expected = feed_in_pieces(model, torch.cat([p, nxt[i]]), [p.numel() + 1])[-1]
        torch.testing.assert_close(step[i], expected, rtol=0, atol=1e-10)


def test_kda_snapshots_equal_state_at_that_point():
    model = tiny_model(dtype=torch.float64)
    cfg = model.config.text_config
    ids = prompt(20, 7)
    cache = HybridCacheTensors.allocate(cfg, num_blocks=8, num_slots=3, block_size=4, dtype=torch.float64)
    table = torch.arange(8)
    model(ids, ForwardBatch([SequenceSlice(20, 0, 0, table, True, snapshots=((8, 1), (16, 2)))], cache))
    for point, slot in ((8, 1), (16, 2)):
        ref = HybridCacheTensors.allocate(cfg, num_blocks=8, num_slots=1, block_size=4, dtype=torch.float64)
        model(ids[:point], ForwardBatch([SequenceSlice(point, 0, 0, table, True)], ref))
        for layer in cfg.kda_layer_ids:
            torch.testing.assert_close(cache.kda_recurrent[layer][slot], ref.kda_recurrent[layer][0],
                                       rtol=0, atol=1e-12)
            torch.testing.assert_close(cache.kda_conv[layer][slot], ref.kda_conv[layer][0], rtol=0, atol=1e-12)


def _image_prompt(model):
    """A prompt whose middle is one image's pad run; returns (ids, embeds [n, D], positions [n])."""
    from engine.model.image_processing import preprocess_image
    from shared.prompt.images import num_image_tokens
    vcfg = model.config.vision_config
    pixels = (torch.arange(60 * 90 * 3) % 251).to(torch.uint8).view(60, 90, 3)
    n = num_image_tokens(vcfg, 60, 90)
    embeds = model.encode_images([preprocess_image(pixels, vcfg)])[0]
    assert embeds.shape[0] == n
    pad = model.config.media_placeholder_token_id
    ids = torch.cat([prompt(5, 1), torch.full((n,), pad), prompt(6, 2)])
    return ids, embeds, torch.arange(5, 5 + n)


def feed_with_image(model, ids, embeds, positions, pieces) -> torch.Tensor:
    runner, outs, done = SequenceRunner(model, 128), [], 0
    for n in pieces:
        inside = (positions >= done) & (positions < done + n)
        outs.append(runner.feed(ids[done:done + n], embeds[inside], positions[inside] - done))
        done += n
    return torch.cat(outs)


def test_image_prompt_prefill_equals_chunks_equals_decode():
    model = tiny_model(vision=True)
    ids, embeds, positions = _image_prompt(model)
    full = feed_with_image(model, ids, embeds, positions, [ids.numel()])
    split_inside_image = feed_with_image(model, ids, embeds, positions, [7, 3, ids.numel() - 10])
    decode = feed_with_image(model, ids, embeds, positions, [1] * ids.numel())
    assert relative_error(split_inside_image, full) <= FP32_REL_TOL
    assert relative_error(decode, full) <= FP32_REL_TOL
    # the image really is used: other pixels, other logits after it
    text_only = feed_in_pieces(model, ids, [ids.numel()])
    assert relative_error(text_only[-1], full[-1]) > 1e-3
