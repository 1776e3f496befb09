"""Offline single-prompt generation (`kimi-pd generate`): checkpoint -> chat prompt -> tokens.

The serving engine batches many requests over a paged cache; this path runs one sequence with
`SequenceRunner` and is the simplest end-to-end use of the model, tokenizer, renderer and vision.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.checkpoint.loader import load_checkpoint
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from engine.model.sequence_runner import SequenceRunner
from engine.tokenizer.chat import render_chat
from engine.tokenizer.tokenizer import KimiTokenizer


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    mm_embeds: torch.Tensor | None = None
    mm_positions: torch.Tensor | None = None


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"


def prepare_prompt(model: KimiK3ForConditionalGeneration, tokenizer: KimiTokenizer, prompt: str,
                   images: list | None = None, thinking: bool = False) -> PreparedPrompt:
    """Render a one-turn chat with optional images; encode the images into embeddings at their pads."""
    from engine.model.image_processing import num_image_tokens, preprocess_image

    images = images or []
    content: str | list = prompt
    counts: list[int] = []
    if images:
        vcfg = model.config.vision_config
        if vcfg is None:
            raise ValueError("this checkpoint has no vision tower; it cannot take images")
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]
        counts = [num_image_tokens(vcfg, img.height, img.width) for img in images]
    rendered = render_chat(tokenizer, [{"role": "user", "content": content}], thinking=thinking,
                           image_token_counts=counts or None)
    if not images:
        return PreparedPrompt(rendered.token_ids)
    pixels = [preprocess_image(img, model.config.vision_config) for img in images]
    dtype = next(model.language_model.parameters()).dtype
    with torch.inference_mode():
        embeds = torch.cat(model.encode_images([p.to(dtype) for p in pixels]))
    positions = torch.cat([torch.arange(start, start + n) for start, n in rendered.image_spans])
    return PreparedPrompt(rendered.token_ids, embeds, positions)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[int, float]:
    """Greedy at temperature 0, else a draw from softmax(logits / T). Returns (token, logprob)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if temperature <= 0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


def generate(model: KimiK3ForConditionalGeneration, tokenizer: KimiTokenizer, prompt: PreparedPrompt,
             max_tokens: int = 32, temperature: float = 0.0, seed: int = 0) -> Generation:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    limit = model.config.text_config.max_position_embeddings
    if len(prompt.token_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt.token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"the model's {limit} positions")
    runner = SequenceRunner(model, len(prompt.token_ids) + max_tokens)
    gen = torch.Generator().manual_seed(seed)
    out = Generation(prompt_token_ids=list(prompt.token_ids))
    logits = runner.feed(prompt.token_ids, prompt.mm_embeds, prompt.mm_positions, last_only=True)[-1]
    for _ in range(max_tokens):
        token, logprob = sample(logits, temperature, gen)
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        if token == tokenizer.eos_id:
            out.finish_reason = "stop"
            break
        if len(out.token_ids) < max_tokens:
            logits = runner.feed([token], last_only=True)[-1]
    out.text = tokenizer.decode([t for t in out.token_ids if t != tokenizer.eos_id], skip_special_tokens=True)
    return out


def load_for_generation(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    return load_checkpoint(model_dir, dtype=dtype), KimiTokenizer.from_dir(model_dir)
