"""The training corpus: task instances rendered by the project's K3 XTML renderer, plus its vocabulary.

`build_tokenizer` makes the checkpoint's own tokenizer: the 256 single bytes, then one rank per
frequent fixed piece of the chat format (tag names, attribute names, the system-message bodies,
the prompt templates' words) and the 256 K3 special tokens. It adds no two-byte rank containing a
letter or digit, so BPE can never merge inside a number, a word to reverse or a city name: those
stay one token per character, which is what makes carrying, reversing and copying learnable for a
small model. Fixed pieces are single tokens, which keeps prompts short.

`render_example` renders one conversation with the target assistant turn and marks which tokens are
that turn (loss is taken on those only).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from engine.training.tasks import FAMILIES, Instance, sample_split
from shared.prompt.bpe_train import NUM_BYTE_RANKS, compile_pattern
from shared.prompt.chat import THINKING_EFFORTS, render_chat
from shared.prompt.tokenizer import KimiTokenizer

VOCAB_SAMPLES_PER_GROUP = 200
VOCAB_MIN_FRACTION = 0.1          # a piece in >= 10 % of one (family, thinking) group's examples


def assistant_message(inst: Instance, thinking: bool) -> dict[str, Any]:
    """The answer turn as an OpenAI assistant message (what the model must generate)."""
    msg: dict[str, Any] = {"role": "assistant", "content": inst.content}
    if thinking:
        msg["reasoning_content"] = inst.reasoning
    if inst.tool_call is not None:
        import json
        msg["tool_calls"] = [{"id": f"{inst.tool_call['name']}:0", "type": "function",
                              "function": {"name": inst.tool_call["name"],
                                           "arguments": json.dumps(inst.tool_call["arguments"])}}]
    return msg


def history(inst: Instance, thinking: bool, keep_history_reasoning: bool) -> list[dict[str, Any]]:
    """The conversation before the answer; earlier assistant turns optionally carry their reasoning."""
    out = []
    for m in inst.messages:
        if m["role"] == "assistant" and thinking and keep_history_reasoning and inst.history_reasoning:
            m = {**m, "reasoning_content": inst.history_reasoning}
        out.append(dict(m))
    return out


@dataclass(frozen=True)
class Example:
    token_ids: list[int]
    num_prompt_tokens: int        # tokens before the answer turn (no loss on them)


def render_example(tok: KimiTokenizer, inst: Instance, thinking: bool, effort: str | None = None,
                   keep_history_reasoning: bool = False) -> Example:
    """Prompt (with generation prompt) + answer turn, rendered exactly as the server renders them."""
    msgs = history(inst, thinking, keep_history_reasoning)
    tools = list(inst.tools) or None
    prompt = render_chat(tok, msgs, tools=tools, thinking=thinking, thinking_effort=effort).token_ids
    full = render_chat(tok, [*msgs, assistant_message(inst, thinking)], tools=tools, thinking=thinking,
                       thinking_effort=effort, add_generation_prompt=False).token_ids
    if full[:len(prompt)] != prompt:
        raise AssertionError(f"{inst.key}: the rendered answer does not extend the generation prompt")
    return Example(full, len(prompt))


@dataclass(frozen=True)
class Mix:
    """How often the variants of a family's conversation are drawn (the family itself is weighted apart).

    `thinking_off` is per family (default 0.5): a direct answer without working is the harder skill
    for arithmetic, and its examples are short, so they are cheap to draw more often. `effort` is the
    share of thinking-on examples with a `thinking_effort` system message (clients rarely send one;
    it adds ~60 prompt tokens); `history_reasoning` the share re-sending an earlier turn's reasoning.
    """

    thinking_off: tuple[tuple[str, float], ...] = ()
    effort: float = 0.6
    history_reasoning: float = 0.5

    def off_share(self, family: str) -> float:
        return dict(self.thinking_off).get(family, 0.5)


def sample_example(tok: KimiTokenizer, rng: random.Random, family_weights: dict[str, float],
                   mix: Mix = Mix()) -> Example:
    """A random training example: family by weight, thinking on/off, effort, history reasoning."""
    family = rng.choices(list(family_weights), weights=list(family_weights.values()))[0]
    inst = sample_split(family, rng, held_out=False)
    thinking = rng.random() >= mix.off_share(family)
    effort = rng.choice(THINKING_EFFORTS) if thinking and rng.random() < mix.effort else None
    return render_example(tok, inst, thinking, effort, keep_history_reasoning=rng.random() < mix.history_reasoning)


# ---- vocabulary --------------------------------------------------------------------------------

class _RecordingTokenizer(KimiTokenizer):
    """Byte-level tokenizer that records every text piece the renderer encodes."""

    def __init__(self) -> None:
        super().__init__({bytes([i]): i for i in range(NUM_BYTE_RANKS)})
        self.pieces: list[str] = []
        self.render_memo = None            # every piece must reach `encode`: a memo hit would skip it

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        self.pieces.append(text)
        return super().encode(text, allow_special)


def _mergeable(piece: bytes) -> bool:
    if len(piece) >= 3:
        return not piece.strip().isdigit()
    return len(piece) == 2 and not any(chr(c).isalnum() for c in piece)


def build_tokenizer(seed: int = 0) -> KimiTokenizer:
    """The tiny-chat tokenizer (deterministic in `seed`): bytes + frequent fixed pieces + K3 specials."""
    rng = random.Random(f"vocab:{seed}")
    pattern = compile_pattern()
    recorder = _RecordingTokenizer()
    keep: Counter[bytes] = Counter()
    for family in FAMILIES:
        for thinking in (False, True):
            counts: Counter[bytes] = Counter()
            for _ in range(VOCAB_SAMPLES_PER_GROUP):
                recorder.pieces.clear()
                inst = sample_split(family, rng, held_out=False)
                render_example(recorder, inst, thinking, rng.choice(THINKING_EFFORTS) if thinking else None)
                pieces = {p.encode() for text in recorder.pieces for p in pattern.findall(text)}
                counts.update(p for p in pieces if _mergeable(p))
            for piece, n in counts.items():
                if n >= VOCAB_MIN_FRACTION * VOCAB_SAMPLES_PER_GROUP:
                    keep[piece] = max(keep[piece], n)
    ranks = {bytes([i]): i for i in range(NUM_BYTE_RANKS)}
    for piece in sorted(keep, key=lambda p: (-keep[p], p)):
        ranks[piece] = len(ranks)
    return KimiTokenizer(ranks, model_max_length=4096)
