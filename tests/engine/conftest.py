from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.checkpoint.init import init_weights
from engine.model.forward_batch import HybridCacheTensors
from engine.model.kda import KDAOptions, KimiDeltaAttention
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


def kda_layer_and_cache(model, num_slots: int, scale: float = 1.0):
    """The model's first KDA layer and a float32 cache whose KDA states for it are random (x scale)."""
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    cfg = model.config.text_config
    cache = HybridCacheTensors.allocate(cfg, num_blocks=8, num_slots=num_slots, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    for store in (cache.kda_conv[layer.layer_id], cache.kda_recurrent[layer.layer_id]):
        store.copy_(torch.randn(store.shape, generator=gen) * scale)
    return layer, cache
