"""Prompt inputs -> validated engine requests: token ids, image features and prefix hashes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import ImageInput
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from shared.errors import InvalidRequest, InvalidTokenIds, PromptTooLong
from shared.hashing import ImageSpan
from shared.prompt.images import content_hash
from shared.prompt.prepare import ImageItem


@dataclass
class EngineInput:
    prompt_token_ids: list[int]
    images: list[ImageItem] = field(default_factory=list)
    resume: Resume | None = None


@dataclass(frozen=True)
class Resume:
    """Continue a request another engine started (its worker died mid-stream): `token_ids` were
    already generated and delivered; they become this request's first outputs (recomputed like a
    preempted request's), so max_tokens, min_tokens, stop strings and penalties count them, and a
    seeded generator first skips the `seed_offset` draws the other engine made."""

    token_ids: list[int]
    seed_offset: int = 0


def checked_max_model_len(asked: int | None, positions: int) -> int:
    """--max-model-len, or the checkpoint's positions; longer is refused as vLLM refuses it (RoPE past
    the trained positions gives garbage, not an error)."""
    if asked is not None and asked > positions:
        raise ValueError(f"User-specified max_model_len ({asked}) is greater than the derived max_model_len "
                         f"(max_position_embeddings={positions} in model's config.json): give --max-model-len "
                         f"<= {positions}")
    return asked or positions


def validate_tokens(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidTokenIds(bad, vocab_size)
    if len(ids) >= max_model_len:
        raise PromptTooLong(len(ids), max_model_len - 1)


def encode_images(model: KimiK3ForConditionalGeneration, items: list[ImageItem], num_tokens: int,
                  media_pad_id: int, token_ids: list[int]) -> list[ImageInput]:
    """Run the vision tower once per image; check each placeholder run matches its feature count."""
    if not items:
        return []
    vcfg = model.config.vision_config
    if not model.has_vision or vcfg is None:      # a vision tower is built exactly when there is a vision config
        raise InvalidRequest("this model has no vision tower; images are not accepted")
    from engine.model.image_processing import preprocess_image
    dtype = next(model.language_model.parameters()).dtype
    out = []
    with torch.inference_mode():
        for item in items:
            end = item.start + item.length
            if item.start < 0 or end > num_tokens or any(t != media_pad_id for t in token_ids[item.start:end]):
                raise InvalidRequest(f"image placeholder run [{item.start}, {end}) is not all <|media_pad|>")
            embeds = model.encode_images([preprocess_image(item.image, vcfg).to(dtype)])[0]
            if embeds.shape[0] != item.length:
                raise InvalidRequest(f"image gives {embeds.shape[0]} features for {item.length} placeholders")
            out.append(ImageInput(ImageSpan(item.start, item.length, content_hash(item.image)), embeds.cpu()))
    return out
