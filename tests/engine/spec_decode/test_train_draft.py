"""train-draft: the dense training forward is the serving proposer's maths; a short run learns."""
from __future__ import annotations

import pytest
import torch

from engine.checkpoint.loader import load_checkpoint
from engine.spec_decode.checkpoint import load_draft
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import DSparkProposer
from engine.spec_decode.train import DraftTrainConfig, block_logits, build_dataset, target_features, train_draft
from tests.engine.spec_decode.conftest import make_llm, prompt_ids, spec


@pytest.mark.parametrize("draft_name", ["draft7", "draft_gqa"])
def test_training_forward_equals_serving_proposer(tiny_dir, draft_name, request):
    draft7 = request.getfixturevalue(draft_name)            # MLA or GQA: the same contract
    target = load_checkpoint(tiny_dir)
    cfg = load_draft(draft7, target.config.text_config)[1]
    prop = DSparkProposer(SpeculativeConfig.parse(spec(draft7)).resolve(cfg, 4096), target, 16, 4,
                          torch.float32, torch.device("cpu"))
    ids = prompt_ids(30, 5)
    feats = target_features(target, ids, prop.capture_layers)
    blocks = list(range(1, 9))
    prop.write_context([(blocks, 0, feats)])
    prop.flush()                                            # context writes are queued until read
    lm = target.language_model
    anchors = torch.tensor([[20, 5], [11, 29]])
    with torch.no_grad():
        _, hidden = block_logits(prop.model, lm.model.embed_tokens, lm.lm_head, feats[None].repeat(2, 1, 1),
                                 torch.ones(2, 30, dtype=torch.bool), torch.tensor([ids, ids]), anchors, 7)
    for b in range(2):
        for m in range(2):
            a = int(anchors[b, m])
            block = torch.full((7,), cfg.mask_token_id)
            block[0] = ids[a]
            contexts = [[p.view(-1, p.shape[-1])[prop._index(blocks, 0, a)]] for p in prop.pages.values()]
            with torch.no_grad():
                served = prop.model.block_hidden(lm.model.embed_tokens(block), torch.arange(a, a + 7), contexts, 7)
            torch.testing.assert_close(served, hidden[b, m], rtol=1e-4, atol=1e-5)


def test_short_training_reduces_loss_and_serves(tiny_dir, tmp_path):
    cfg = DraftTrainConfig(num_sequences=8, max_new_tokens=24, steps=40, batch_sequences=4, anchors_per_sequence=6,
                           lr=3e-3)
    from engine.spec_decode.checkpoint import default_target_layers
    layers = tuple(default_target_layers(6))
    data = build_dataset(tiny_dir, cfg, layers, prompts=[prompt_ids(12, 100 + i) for i in range(8)])
    result = train_draft(tiny_dir, tmp_path / "trained", cfg, progress=False, data=data)
    import json
    losses = json.loads((tmp_path / "trained" / "train_log.json").read_text())["losses"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert result["sequences"] == 8
    llm = make_llm(tiny_dir, speculative_config=spec(tmp_path / "trained"))
    plain = make_llm(tiny_dir)
    from tests.engine.spec_decode.conftest import GREEDY, tokens
    assert tokens(llm.generate([prompt_ids(12, 100)], GREEDY)) == tokens(plain.generate([prompt_ids(12, 100)], GREEDY))
