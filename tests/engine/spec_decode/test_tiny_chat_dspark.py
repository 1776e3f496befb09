"""The shipped trained pair (`tiny-chat` + `tiny-chat-dspark`): speculative greedy == plain greedy on
held-out task prompts, and the draft really is trained (most drafts are accepted)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.spec_decode.checkpoint import load_draft, shipped_draft


def test_preset_copies_the_shipped_draft(tmp_path):
    out = tmp_path / "draft"
    cmd = [sys.executable, "-m", "kimi_pd", "checkpoint", "create", "--preset", "tiny-chat-dspark", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    shipped = shipped_draft("tiny-chat-dspark")
    assert (out / "config.json").read_text() == (shipped / "config.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "k3_dspark" and config["block_size"] == 7
    log = json.loads((out / "train_log.json").read_text())
    assert log["final_top1"] > 0.8                                   # a distilled draft, not a random one


@pytest.fixture(scope="module")
def target():
    """The shipped tiny-chat (issue 9's preset): the target this draft was distilled from."""
    presets = pytest.importorskip("engine.presets")
    if not hasattr(presets, "shipped_checkpoint"):
        pytest.skip("the tiny-chat preset (issue 9) is not in this tree")
    return presets.shipped_checkpoint("tiny-chat")


def test_trained_pair_greedy_equals_plain_and_drafts_are_accepted(target):
    corpus = pytest.importorskip("engine.training.corpus")
    tasks = pytest.importorskip("engine.training.tasks")
    draft = shipped_draft("tiny-chat-dspark")
    load_draft(draft, LLM(str(target), max_num_seqs=1).engine.model.config.text_config)
    plain = LLM(str(target), max_num_seqs=8)
    spec = LLM(str(target), max_num_seqs=8, speculative_config={"method": "dspark", "model": "tiny-chat-dspark"})
    rng = random.Random(0)
    prompts = []
    for family in tasks.FAMILIES:
        for inst in tasks.eval_instances(family, 1, seed=99):
            ex = corpus.render_example(plain.tokenizer, inst, thinking=rng.random() < 0.5)
            prompts.append(ex.token_ids[: ex.num_prompt_tokens])
    params = SamplingParams(temperature=0.0, max_tokens=80)
    want = [o.output.token_ids for o in plain.generate(prompts, params)]
    got = [o.output.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.spec_stats
    assert stats.mean_acceptance_length >= 3.0, stats
    spec.engine.check_integrity()


def test_trained_pair_constrained_greedy_equals_plain(target):
    """Masks at verification with the trained draft: json schema, choice, bad words, allowed ids +
    logit bias; outputs equal plain greedy whatever the draft's acceptance on them."""
    pytest.importorskip("xgrammar")
    from dataclasses import replace

    from shared.structured_output import StructuredOutput
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"],
              "additionalProperties": False}
    plain = LLM(str(target), max_num_seqs=8)
    spec = LLM(str(target), max_num_seqs=8, speculative_config={"method": "dspark", "model": "tiny-chat-dspark"})
    asks = ["What is 12 plus 7? Reply in JSON.", "Is the sky blue? Answer yes or no.", "Name a colour.",
            "Count from one to five."]
    prompts = [plain.render([{"role": "user", "content": a}], thinking=False) for a in asks]
    free = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    base = SamplingParams(temperature=0.0, max_tokens=40)
    params = [replace(base, structured_output=StructuredOutput("json", json.dumps(schema))),
              replace(base, structured_output=StructuredOutput("choice", json.dumps(["yes", "no"]))),
              replace(base, bad_words=[plain.tokenizer.decode(free[2].output.token_ids[:1]).strip() or "a"]),
              replace(base, allowed_token_ids=sorted(set(free[3].output.token_ids[::2]) | {plain.tokenizer.eos_id}),
                      logit_bias={free[3].output.token_ids[0]: -5.0})]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.output.token_ids for o in got] == [o.output.token_ids for o in want]
    assert got[0].output.finish_reason == "stop" and isinstance(json.loads(got[0].output.text)["answer"], int)
    assert got[1].output.text in ("yes", "no")
    assert spec.engine.spec_stats.num_drafts > 0
    spec.engine.check_integrity()
