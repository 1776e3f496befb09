"""P and D at different TP sizes: exported states always have the TP=1 layout (KDA heads gathered on
export, split on import), so a TP=2 prefill feeds a TP=1 decode and the reverse, token for token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel.state_layout import gather_kda, split_kda

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SETTINGS = dict(block_size=4, kda_chunk_size=8, max_num_seqs=4, max_num_batched_tokens=512,
                cache_memory_bytes=4 << 20, snapshot_interval_blocks=2, dtype="float64")
PROMPT = np.random.default_rng(7).integers(0, 1024, 19).tolist()


def test_split_then_gather_is_identity_for_any_world_size():
    conv = {1: torch.randn(3, 3 * 4 * 16)}
    rec = {1: torch.randn(4, 16, 16)}
    for world in (1, 2, 4):
        shards = [split_kda(conv, rec, r, world) for r in range(world)]
        assert shards[0][1][1].shape == (4 // world, 16, 16)
        back_conv, back_rec = gather_kda(shards)
        assert torch.equal(back_conv[1], conv[1]) and torch.equal(back_rec[1], rec[1])
    # rank 1 of 2 holds heads 2..3 of each of q, k and v
    q, k, v = conv[1].chunk(3, dim=-1)
    assert torch.equal(split_kda(conv, rec, 1, 2)[0][1], torch.cat([q[:, 32:], k[:, 32:], v[:, 32:]], dim=-1))


def prefill(llm: LLM, rid: str):
    llm.engine.add_request(rid, PROMPT, GREEDY, export_state=True)
    while llm.engine.has_unfinished():
        llm.engine.step()
    state = llm.engine.export_state(rid)
    assert llm.engine.release_export(rid)
    return state


def decode(llm: LLM, rid: str, state) -> list[int]:
    llm.engine.add_request(rid, state.prompt_token_ids, GREEDY, imported=state)
    final = None
    while llm.engine.has_unfinished():
        final = [o for o in llm.engine.step() if o.finished] or final
    llm.engine.check_integrity()
    return final[0].output.token_ids


def test_tp2_prefill_to_tp1_decode_and_back_equal_colocated(tiny_dir):
    tp1 = LLM(str(tiny_dir), **SETTINGS)
    colocated = tp1.generate([PROMPT], GREEDY)[0].output.token_ids
    state_tp1 = prefill(tp1, "p1")
    with LLM(str(tiny_dir), tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS) as tp2:
        state_tp2 = prefill(tp2, "p2")
        # the gathered TP=2 state is the TP=1 state, tensor for tensor
        for kind in ("mla", "kda_conv", "kda_recurrent"):
            a, b = getattr(state_tp1, kind), getattr(state_tp2, kind)
            assert a.keys() == b.keys() and all(a[i].shape == b[i].shape for i in a)
            assert max(float((a[i] - b[i]).abs().max()) for i in a) < 1e-10, kind
        assert decode(tp1, "d-from-tp2", state_tp2) == colocated             # TP=2 prefill -> TP=1 decode
        assert decode(tp2, "d-from-tp1", state_tp1) == colocated             # TP=1 prefill -> TP=2 decode
        bad = state_tp1.__class__(**{**vars(state_tp1), "kda_recurrent": {i: t[:1] for i, t in
                                                                          state_tp1.kda_recurrent.items()}})
        from engine.core.state_export import StateMismatch
        with pytest.raises(StateMismatch, match="kda_recurrent"):       # refused on rank 0, before any broadcast
            decode(tp2, "bad", bad)
