"""The shipped tiny-chat checkpoint: preset copy, size, loading, offline eval, paged decode == training forward."""
from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.create import create_checkpoint
from engine.checkpoint.loader import load_checkpoint
from engine.llm import LLM
from engine.presets import shipped_checkpoint
from engine.training.corpus import history
from engine.training.dense_forward import dense_logits
from engine.training.tasks import FAMILIES, eval_instances
from kimi_pd.cli import main
from shared.prompt.tokenizer import KimiTokenizer
from shared.sampling_params import SamplingParams

MAX_SHIPPED_BYTES = 30 * 2**20


@pytest.fixture(scope="module")
def shipped():
    return shipped_checkpoint("tiny-chat")


def test_preset_copies_the_shipped_checkpoint(tmp_path, shipped):
    out = create_checkpoint("tiny-chat", tmp_path / "tc")
    names = sorted(f.name for f in shipped.iterdir() if f.is_file())
    assert sorted(f.name for f in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (shipped / name).read_bytes()
    weights = sum(f.stat().st_size for f in shipped.glob("*.safetensors"))
    assert 0 < weights <= MAX_SHIPPED_BYTES
    with pytest.raises(ValueError, match="seed"):
        create_checkpoint("tiny-chat", tmp_path / "x", seed=3)


def test_shipped_checkpoint_loads_with_every_mixer_and_vision(shipped):
    model = load_checkpoint(shipped)
    cfg = model.config.text_config
    assert cfg.kda_layer_ids and cfg.mla_layer_ids and cfg.num_experts > 0 and model.has_vision
    assert len({i // cfg.attn_res_block_size for i in range(cfg.num_hidden_layers)}) >= 2
    tok = KimiTokenizer.from_dir(shipped)
    assert tok.vocab_size == cfg.vocab_size and model.config.eos_token_id == tok.eos_id


def test_engine_greedy_decode_equals_the_training_forward(shipped):
    """The engine's paged decode (chunked prefill, recurrent KDA, absorbed MLA) picks the same tokens as
    greedy decoding with the dense forward the model was trained with."""
    llm = LLM(model=str(shipped), max_num_seqs=4)
    model = llm.engine.model
    for family, thinking in (("add", True), ("reverse", False), ("tool_call", True), ("multi_turn", False)):
        inst = eval_instances(family, 1)[0]
        prompt = llm.render(history(inst, thinking, False), tools=list(inst.tools) or None, thinking=thinking)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False))[0]
        ids = list(prompt.prompt_token_ids)
        with torch.no_grad():
            for _ in range(len(out.output.token_ids)):
                ids.append(int(dense_logits(model, torch.tensor([ids]))[0, -1].argmax()))
        assert ids[len(prompt.prompt_token_ids):] == out.output.token_ids, family


def test_eval_command_scores_every_family_offline(capsys):
    assert main(["checkpoint", "eval", "--n", "2", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert {(s["family"], s["thinking"]) for s in scores} == {(f, t) for f in FAMILIES for t in (False, True)}
    assert all(s["total"] == 2 and 0 <= s["correct"] <= 2 for s in scores)
