"""benchmarks/spec_decode.py's interleaved timing: engines stepped in turn decode exactly what each would
alone, and every step after the prefill is counted (the benchmark's ratios rest on both)."""
from __future__ import annotations

from benchmarks.spec_decode import interleaved_decode, timed_decode
from tests.engine.spec_decode.conftest import make_llm, prompt_ids, spec


def test_engines_stepped_in_turn_decode_what_each_decodes_alone(tiny_dir, draft7):
    prompts = [prompt_ids(12, seed) for seed in range(3)]
    llms = {"plain": make_llm(tiny_dir), "fixed": make_llm(tiny_dir, speculative_config=spec(draft7))}
    together = interleaved_decode(llms, prompts, max_tokens=10)
    alone = make_llm(tiny_dir)
    expected, _, tokens = timed_decode(alone, prompts, max_tokens=10)
    for name, (outputs, seconds, decoded) in together.items():
        assert outputs == expected, name                     # greedy: speculation never changes the answer
        assert seconds > 0
        # the prefill step's first token is not timed: the rest of each answer is, speculating or not
        assert decoded == sum(len(o) for o in outputs) - len(prompts), name
    assert tokens == sum(len(o) for o in expected) - len(prompts)
    assert all(not llm.engine.has_unfinished() for llm in llms.values())
