"""Whole-layer decode calls in C (engine/model/decode_ops.py) give bitwise what the Python path gives.

- a latent MoE layer on one token (`moe_row`) == `LatentMoE.forward` with the whole-layer calls off,
  with and without shared experts and the latent norm, over many tokens (so many expert choices);
- the plan declines where the C call would not reproduce the Python path (small weights on MKL, expert
  parallelism, a forward on more threads, more than one row) and the Python path runs;
- `KIMI_PD_CPU_DECODE_LAYERS=0` turns the whole-layer calls off (a child process).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from engine.model import decode_ops
from engine.model.moe import LatentMoE
from engine.presets import preset_config
from tests.engine.conftest import tiny_model

needs_ops = pytest.mark.skipif(decode_ops.decode_ops() is None, reason="no C compiler / not x86-64 Linux with AVX-512F")


def _moe(shared: int = 1, norm: bool = True, seed: int = 0) -> LatentMoE:
    """A latent MoE whose linears are all large enough for the rowdot kernels (at least 128K elements)."""
    cfg = replace(preset_config("tiny").text_config, hidden_size=512, num_experts=8, num_experts_per_token=3,
                  moe_intermediate_size=512, routed_expert_hidden_size=256, num_shared_experts=shared,
                  latent_moe_use_norm=norm)
    moe = LatentMoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    moe.fuse_linears()
    return moe.eval()


def _count_calls(monkeypatch) -> list[int]:
    ops = decode_ops.decode_ops()
    calls: list[int] = []
    real = ops.moe_row
    monkeypatch.setattr(ops, "moe_row", lambda *a: calls.append(1) or real(*a))
    return calls


def _both_paths(moe: LatentMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        decode_ops.set_layers_enabled(False)
        try:
            python = moe(x)
        finally:
            decode_ops.set_layers_enabled(True)
        return python, moe(x)


@needs_ops
@pytest.mark.parametrize("shared, norm", [(1, True), (0, True), (2, False)])
def test_moe_row_in_c_equals_the_python_path_bitwise(monkeypatch, one_thread, shared, norm):
    moe = _moe(shared, norm)
    calls = _count_calls(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    chosen = set()
    for i in range(24):
        x = torch.randn(1, 512, generator=gen) * (1 + i % 4)
        python, in_c = _both_paths(moe, x)
        assert torch.equal(python, in_c), (i, (python - in_c).abs().max())
        with torch.inference_mode():
            chosen.add(tuple(moe.gate.logits(x).topk(3).indices[0].tolist()))
    assert len(calls) == 24
    assert len(chosen) > 5                               # many different expert sets were compared


@needs_ops
def test_moe_row_declines_where_it_would_not_reproduce_the_python_path(monkeypatch, one_thread):
    calls = _count_calls(monkeypatch)
    small = tiny_model()                                 # every weight under 128K elements: MKL's products
    small.fuse_linears()
    tiny_moe = next(m for m in small.modules() if isinstance(m, LatentMoE))
    assert tiny_moe._row_plan() is None
    moe = _moe()
    x = torch.randn(1, 512)
    moe.expert_range = (0, 4)                            # expert parallelism: this rank's experts only
    assert moe._row_plan() is None
    moe.expert_range = None
    assert moe._row_plan() is not None
    with torch.inference_mode():
        torch.set_num_threads(2)                         # a threaded forward keeps oneDNN's products
        try:
            assert moe._row_in_c(x) is None
        finally:
            torch.set_num_threads(1)
        moe(torch.randn(2, 512))                         # two rows: the Python path
        assert not calls
        moe(x)
    assert len(calls) == 1


CHILD = """
import torch
from engine.model import decode_ops
with torch.inference_mode():
    print("layers", decode_ops.layer_usable(torch.zeros(1)) is not None)
"""


@needs_ops
@pytest.mark.parametrize("value, expect", [("0", "layers False"), ("1", "layers True")])
def test_the_whole_layer_calls_can_be_turned_off(value, expect):
    env = {**os.environ, decode_ops.LAYERS_ENV: value}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout
