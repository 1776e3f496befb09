"""tiny-chat training: vocabulary, corpus rendering, hash split, dense == serving forward, a few steps learn."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from engine.model.sequence_runner import SequenceRunner
from engine.training.corpus import build_tokenizer, render_example
from engine.training.dense_forward import dense_logits
from engine.training.tasks import (
    FAMILIES,
    add_working,
    eval_instances,
    is_held_out,
    make_reverse,
    make_sub,
    sample_split,
    signed_diff_working,
)
from engine.training.train import BatchStream, TrainConfig, make_batch, masked_loss, new_model, setup_determinism
from shared.prompt.parsers import parse_tool_calls, split_reasoning

SMALL = TrainConfig(hidden_size=32, num_layers=4, tokens_per_step=768, steps=12, lr=1e-2, warmup_steps=2,
                    kda_chunk_size=8, pool_batches=4, workers=1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(0)


def test_vocabulary_keeps_digits_and_letters_single_tokens(tok):
    assert tok.vocab_size == tok.num_ranks + 256 and tok.id_of("<|open|>") == tok.num_ranks + 3
    for text in ("347", "-135", "qzxwv", " hello", "Tallinn"):
        ids = tok.encode(text)
        assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    # fixed pieces of the format are single tokens
    assert len(tok.encode("assistant")) == 1 and len(tok.encode(" numbers")) == 1
    assert build_tokenizer(0).encode("What is the weather in Oslo?") == tok.encode("What is the weather in Oslo?")


def test_hash_split_keeps_eval_instances_out_of_training():
    rng = random.Random(0)
    for family in FAMILIES:
        held = eval_instances(family, 20)
        assert len({i.key for i in held}) == 20 and all(is_held_out(i.key) for i in held)
        assert eval_instances(family, 20) == held
        train_keys = {sample_split(family, rng, held_out=False).key for _ in range(200)}
        assert not train_keys & {i.key for i in held}


@pytest.mark.parametrize("a,b", [(0, 0), (999, 1), (347, 586), (5, 998), (100, 99), (12, 700)])
def test_arithmetic_working_ends_in_the_answer(a, b):
    assert add_working(a, b).splitlines()[-1].split()[-1] == str(a + b)
    last = signed_diff_working(a, b).splitlines()[-1].split()[-1]
    assert int(last) == abs(a - b)


@pytest.mark.parametrize("thinking", [False, True])
def test_rendered_answer_parses_back_to_the_expected_answer(tok, thinking):
    rng = random.Random(1)
    for family in FAMILIES:
        inst = sample_split(family, rng, held_out=False)
        ex = render_example(tok, inst, thinking)
        text = tok.decode(ex.token_ids[ex.num_prompt_tokens:])
        split = split_reasoning(text, thinking=thinking)
        assert split.content == inst.content
        assert split.reasoning == (inst.reasoning if thinking else "")
        calls = parse_tool_calls(text, thinking=thinking)
        if inst.tool_call:
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
                [(inst.tool_call["name"], inst.tool_call["arguments"])]
        else:
            assert calls == []
        assert ex.token_ids[-1] == tok.eos_id


@pytest.mark.parametrize("chunk", [8, 16])
def test_dense_training_forward_equals_serving_forward(tok, chunk):
    """The forward trained with is the forward served: same logits on real prompts of every family."""
    setup_determinism(SMALL)
    model = new_model(tok, SMALL).eval()
    rng = random.Random(2)
    examples = [render_example(tok, sample_split(f, rng, held_out=True), th) for f in FAMILIES for th in (False, True)]
    ids, _, _ = make_batch(examples, tok.pad_id)
    with torch.no_grad():
        dense = dense_logits(model, ids, chunk)
    for i, ex in enumerate(examples):
        served = SequenceRunner(model, 1024).feed(ex.token_ids[:-1])
        torch.testing.assert_close(dense[i, :len(ex.token_ids) - 1], served, atol=2e-4, rtol=1e-4)
        assert torch.equal(dense[i, :len(ex.token_ids) - 1].argmax(-1), served.argmax(-1))


def _run_steps(tok, cfg: TrainConfig, steps: int):
    setup_determinism(cfg)
    model = new_model(tok, cfg)
    opt = torch.optim.AdamW(model.language_model.parameters(), lr=cfg.lr)
    stream = BatchStream(tok, cfg, random.Random(cfg.seed))
    fixed = make_batch(stream.next(), tok.pad_id)
    with torch.no_grad():
        before = masked_loss(model, fixed, cfg.kda_chunk_size).item()
    for _ in range(steps):
        loss = masked_loss(model, fixed, cfg.kda_chunk_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = masked_loss(model, fixed, cfg.kda_chunk_size).item()
    return model, before, after


def test_a_few_training_steps_from_the_seed_reduce_the_loss(tok):
    _, before, after = _run_steps(tok, SMALL, 6)
    assert after < 0.8 * before, (before, after)


def test_training_is_deterministic_from_the_seed(tok):
    a, _, _ = _run_steps(tok, SMALL, 2)
    b, _, _ = _run_steps(tok, SMALL, 2)
    c, _, _ = _run_steps(tok, replace(SMALL, seed=1), 2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_instances_follow_the_templates():
    assert make_reverse("hello").messages[0]["content"] == "Reverse the word: hello"
    assert make_reverse("hello").content == "olleh"
    inst = make_sub(12, 700)
    assert inst.messages[0]["content"] == "What is 12 - 700?" and inst.content == "-688"


@pytest.mark.parallel          # two gloo ranks, twice: 14 s on two cores, so in the parallel suite
def test_data_parallel_training_is_deterministic_and_writes_the_checkpoint(tmp_path):
    """Two worker processes (gloo all-reduce): same seed, same losses and tensors; the result loads."""
    from safetensors.torch import load_file

    from engine.checkpoint.loader import load_checkpoint
    from engine.training.train import train

    cfg = replace(SMALL, workers=2, steps=3)
    runs = [train(cfg, tmp_path / name, progress=False) for name in ("a", "b")]
    assert runs[0]["losses"] == runs[1]["losses"] and len(runs[0]["losses"]) == 3
    ta, tb = (load_file(next((tmp_path / n).glob("*.safetensors"))) for n in ("a", "b"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert load_checkpoint(tmp_path / "a").config.text_config.num_hidden_layers == SMALL.num_layers
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0
