"""Shared fixtures: the tiny target and random DSpark drafts (Block7, Block5) for it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec_decode.checkpoint import create_draft_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=8, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's tensors are too small for intra-op threads on 2 shared cores (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)




@pytest.fixture(scope="session")
def draft7(tiny_dir, tmp_path_factory) -> Path:
    return create_draft_checkpoint(tiny_dir, tmp_path_factory.mktemp("spec") / "draft7", block=7, seed=1)


@pytest.fixture(scope="session")
def draft5(tiny_dir, tmp_path_factory) -> Path:
    return create_draft_checkpoint(tiny_dir, tmp_path_factory.mktemp("spec") / "draft5", block=5, seed=2)


@pytest.fixture(scope="session")
def draft_gqa(tiny_dir, tmp_path_factory) -> Path:
    """A random GQA (Qwen3-style) Block7 draft for the tiny target."""
    return create_draft_checkpoint(tiny_dir, tmp_path_factory.mktemp("spec") / "draft-gqa", block=7, seed=3,
                                   attention="gqa")


def spec(draft: Path, **fields) -> dict:
    return {"method": "dspark", "model": str(draft), **fields}


def make_llm(tiny_dir, **overrides) -> LLM:
    return LLM(str(tiny_dir), **{**SETTINGS, **overrides})


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1024, n).tolist()


def tokens(outputs) -> list[list[int]]:
    return [o.output.token_ids for o in outputs]


def oracle_drafts(llm: LLM, references: dict[tuple[int, ...], list[int]], wrong_at) -> None:
    """Replace the draft with the known greedy continuation, corrupted at `wrong_at(step)` (None: exact),
    so tests control how many drafts each verification accepts."""
    speculation = llm.engine.speculation          # the engine's speculative step (engine/spec_decode/step.py)
    counter = iter(range(10**9))

    def propose(candidates, verify_s=None, step_started=None):
        capped = [(r, k) for r in candidates if (k := speculation.num_drafts_for(r)) > 0]
        for (req, _), k in zip(capped, speculation.choose(capped), strict=True):     # the configured policy
            if k == 0:
                continue
            full = references[tuple(req.prompt_token_ids)]
            v = req.num_computed_tokens
            drafts = list(full[v + 1: v + 1 + k])
            if len(drafts) < k:
                continue
            bad = wrong_at(next(counter))
            if bad is not None and bad < k:
                drafts[bad] = (drafts[bad] + 1) % 1000
            req.spec_token_ids = drafts
        return len(candidates)

    speculation.propose = propose
