"""Helpers of the engine-runtime tests: the tiny preset with small pages and chunks, so short prompts
cross block, chunk and snapshot boundaries."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image

from engine import LLM, SamplingParams
from engine.core.inputs import EngineInput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2)


def make_llm(tiny_dir, **overrides) -> LLM:
    return LLM(str(tiny_dir), **{**SETTINGS, **overrides})


def record_step_logits(runner) -> list:
    """Wrap `runner.execute` so every engine step's logits are kept (cloned), in step order: the
    record equivalence tests compare step by step."""
    logits, execute = [], runner.execute

    def recording(out):
        result = execute(out)
        logits.append(result.logits.clone())
        return result

    runner.execute = recording
    return logits


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1024, n).tolist()


def image_input(llm: LLM, seed: int = 0) -> EngineInput:
    pixels = np.random.default_rng(seed).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    return llm.render([{"role": "user", "content": [{"type": "image", "image": Image.fromarray(pixels)},
                                                    {"type": "text", "text": "what is this?"}]}], thinking=False)


def tokens(outputs) -> list[list[int]]:
    return [o.output.token_ids for o in outputs]


def assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert not llm.engine.requests and not llm.engine.held
    assert llm.engine.cache.pool.num_free == llm.engine.cache.pool.usable_blocks
    assert llm.engine.cache.slots.num_free_working == llm.engine.cache_config.num_working_slots


@contextmanager
def no_forward(llm: LLM) -> Iterator[None]:
    """Bookkeeping that must not run the model: any forward inside the block fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the model ran a forward where only bookkeeping was expected")

    runner = llm.engine.runner
    runner.execute = forbidden
    try:
        yield
    finally:
        del runner.execute


def bannable_word(tokenizer, ids: list[int]) -> str:
    """Text of some of `ids` that encodes back to exactly those ids (longest first)."""
    for length in (2, 1):
        for i in range(len(ids) - length + 1):
            piece = ids[i:i + length]
            if tokenizer.encode(tokenizer.decode(piece)) == piece:
                return tokenizer.decode(piece)
    raise AssertionError("no round-tripping piece")
