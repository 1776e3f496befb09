from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.checkpoint.init import init_weights
from engine.model.kda import KDAOptions
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration, ModelOptions
from engine.presets import preset_config

TEST_KDA_CHUNK = 8      # docs/model.md, Presets: chunk 8 makes short prompts cross chunk boundaries


def tiny_model(options: ModelOptions | None = None, dtype=torch.float32, seed: int = 0,
               vision: bool = False) -> KimiK3ForConditionalGeneration:
    cfg = preset_config("tiny")
    if not vision:
        cfg = replace(cfg, vision_config=None)
    model = KimiK3ForConditionalGeneration(cfg, options or ModelOptions(kda=KDAOptions(chunk_size=TEST_KDA_CHUNK)))
    init_weights(model, seed)
    return model.to(dtype).eval()


@pytest.fixture
def one_thread():
    """A forward on one intra-op thread, as the engine runs small ones (engine/host_threads.py); the count
    is restored after the test, which may change it again."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="session")
def tiny_config():
    return preset_config("tiny")
