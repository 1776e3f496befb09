"""benchmarks/engine_step_child.py: a decode step's bytes count the routed experts its MoE layers read."""
from __future__ import annotations

from benchmarks.engine_step_child import decode_answer, routed_experts, weight_bytes_per_step
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
