"""benchmarks/engine_step_child.py and engine_throughput.py: a decode step's bytes count the routed experts its
MoE layers read; the fractions divide by the best probe of their condition."""
from __future__ import annotations

import argparse

import torch

from benchmarks.engine_step_child import decode_answer, measure_read_bandwidth, routed_experts, weight_bytes_per_step
from benchmarks.engine_throughput import rows
from engine.core.engine import EngineConfig, LLMEngine


def test_bytes_count_the_experts_the_batch_was_routed_to(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=8, cache_memory_bytes=32 << 20))
    try:
        cfg = engine.model.config.text_config
        answer = decode_answer(engine, {"batch": 8, "steps": 3, "prompt_tokens": 12})
        routed = answer["experts_per_layer"]
        # each of the 8 tokens picks top_k distinct experts; together they read at most all of them
        assert cfg.num_experts_per_token <= routed <= min(cfg.num_experts, 8 * cfg.num_experts_per_token)
        touchable = min(cfg.num_experts, 8 * cfg.num_experts_per_token)
        bound, dense = weight_bytes_per_step(engine, 8), weight_bytes_per_step(engine, 8, 0)
        assert weight_bytes_per_step(engine, 8, touchable) == bound > dense
        # the routed count scales the experts' share: an overcount no more once tokens share experts
        assert abs(weight_bytes_per_step(engine, 8, routed) - (dense + (bound - dense) * routed / touchable)) <= 1
        with routed_experts(1) as counts:                 # one token reads exactly top_k experts per layer
            decode_answer(engine, {"batch": 1, "steps": 2, "prompt_tokens": 12})
        assert counts and set(counts) == {cfg.num_experts_per_token}
    finally:
        engine.close()


def test_routed_experts_counts_a_layer_run_in_one_c_call(monkeypatch):
    from engine.model.moe import LatentMoE
    from engine.presets import preset_config
    moe = LatentMoE(preset_config("tiny").text_config)
    hidden = moe.routed_expert_up_proj.weight.shape[0]
    # as where the whole layer runs in C: the Python dispatch, which the counter also watches, never runs
    monkeypatch.setattr(LatentMoE, "_rows_in_c", lambda self, x: torch.zeros(1, hidden))
    with routed_experts(1) as counts, torch.inference_mode():
        moe(torch.zeros(1, hidden))
        moe(torch.zeros(1, hidden))
    assert counts == [moe.top_k, moe.top_k]


def test_read_probe_reports_one_thread_and_all_and_restores_the_count():
    was = torch.get_num_threads()
    got = measure_read_bandwidth(max(2, was), nbytes=8 << 20, repeats=2)
    assert got["one_thread"] > 0 and got["all_threads"] > 0
    assert torch.get_num_threads() == was


class _FakeChild:
    def __init__(self, name: str, moved: int) -> None:
        self.name, self.moved = name, moved

    def ask(self, **req):
        assert req["op"] == "bytes"
        return {"bytes": self.moved if req.get("experts_per_layer") is not None else 2 * self.moved}


def test_rows_divide_by_the_best_one_thread_read_rate_of_the_condition():
    args = argparse.Namespace(competitors=[0, 1], batch_sizes=[1], prompt_tokens=8)
    a, b = _FakeChild("a", 1000), _FakeChild("b", 1000)
    raw = {"steps": {(c, n, 1): [0.5, 0.5, 0.7] for c in "ab" for n in (0, 1)},
           "bandwidth": {("a", 0): [8000.0], ("b", 0): [10000.0], ("a", 1): [5000.0], ("b", 1): [4000.0]},
           "read_one_thread": {("a", 0): [3000.0], ("b", 0): [4000.0], ("a", 1): [2000.0], ("b", 1): [1000.0]},
           "read_all_threads": {("a", 0): [5000.0], ("b", 0): [6000.0], ("a", 1): [3000.0], ("b", 1): [3500.0]},
           "experts": {(c, 1): [4.0] for c in "ab"}}
    got = {(r["variant"], r["competitors"]): r for r in rows([a, b], raw, args)}
    quiet, busy = got[("a", 0)], got[("a", 1)]
    # every variant of a condition is divided by the best probe any variant saw in it
    assert quiet["read_one_thread_bytes_per_s"] == 4000.0 and busy["read_one_thread_bytes_per_s"] == 2000.0
    assert quiet["read_all_threads_bytes_per_s"] == 6000.0 and busy["read_all_threads_bytes_per_s"] == 3500.0
    assert quiet["fraction_of_one_thread_read"] == 1000 / 0.5 / 4000.0
    assert busy["fraction_of_one_thread_read"] == 1000 / 0.5 / 2000.0
    assert quiet["roofline_fraction"] == 1000 / 0.5 / 10000.0


class _CopyingChild:
    """An engine child whose decodes make `made[i]` weight copies in all by the i-th call."""

    def __init__(self, name: str, made: list[int]) -> None:
        self.name, self.made, self.calls = name, made, 0

    def ask(self, **req):
        copies = self.made[min(self.calls, len(self.made) - 1)]
        self.calls += 1
        return {"step_s": 0.001 * self.calls, "experts_per_layer": None, "kept_copies": copies}


def test_warm_up_decodes_until_no_new_weight_copies_and_reports_those_steps():
    from benchmarks.engine_throughput import WARMUP_MAX_DECODES, warm_up
    args = argparse.Namespace(batch_sizes=[8], steps=4, prompt_tokens=16)
    settling, endless = _CopyingChild("a", [5, 9, 12, 12]), _CopyingChild("b", list(range(1, 100)))
    out = warm_up([settling, endless], args)
    assert settling.calls == 4                       # the 4th decode made nothing new: warm
    assert out["a"]["8"] == [1.0, 2.0, 3.0, 4.0]    # each untimed decode's step, ms
    assert endless.calls == WARMUP_MAX_DECODES       # bounded, even for an engine that keeps copying
