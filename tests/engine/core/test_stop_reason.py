"""`stop_reason` as vLLM reports it: null when the model ends on its own (eos), the token id for a
`stop_token_ids` hit, the string for a stop string."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

ASK = [{"role": "user", "content": "Reverse the word: kimi"}]


@pytest.fixture(scope="module")
def llm():
    presets = pytest.importorskip("engine.presets")
    return LLM(str(presets.shipped_checkpoint("tiny-chat")), max_num_seqs=4)


def test_stop_reason_is_null_at_a_natural_end_and_names_what_stopped_otherwise(llm):
    base = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False)
    natural = llm.chat(ASK, base, thinking=False)[0].output
    assert natural.finish_reason == "stop" and natural.stop_reason is None
    assert natural.token_ids[-1] == llm.tokenizer.eos_id                 # it did end on the eos token
    first = natural.token_ids[0]
    by_token = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[first]), thinking=False)
    assert (by_token[0].output.finish_reason, by_token[0].output.stop_reason) == ("stop", first)
    word = llm.tokenizer.decode(natural.token_ids[:2])
    by_string = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40, stop=[word]), thinking=False)
    assert by_string[0].output.stop_reason == word
