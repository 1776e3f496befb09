"""On a CUDA machine (the `device` tool): captured graphs replay == eager, engine tokens unchanged."""
from __future__ import annotations

import pytest
import torch

from engine.graphs.capture import StaticGraphs, graph_backend
from engine.model.kda_ops import causal_conv_step, kda_recurrent
from tests.engine.core.helpers import record_step_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_kda_decode_step_graph_replays_equal_eager():
    backend = graph_backend("cuda")
    assert backend is not None and backend.name == "cuda"
    h, k, c = 2, 16, 3 * 2 * 16
    weight = torch.randn(c, 4, device="cuda")

    def step(x, conv, q, kk, v, g, beta, state):
        y, _ = causal_conv_step(x, weight, conv)
        o, s = kda_recurrent(q, kk, v, g, beta, state, k ** -0.5)
        return o.sum() + y.sum() + s.sum()

    def inputs(b, seed=None):             # a batch of b; captured with seed b, replayed with others
        gen = torch.Generator(device="cuda").manual_seed(b if seed is None else seed)
        r = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)   # noqa: E731
        return dict(x=r(b, c), conv=r(b, 3, c), q=r(b, 1, h, k), kk=r(b, 1, h, k), v=r(b, 1, h, k),
                    g=-r(b, 1, h, k).abs(), beta=r(b, 1, h).sigmoid(), state=r(b, h, k, k))

    graphs = StaticGraphs(backend, step, inputs, (1, 2, 4))
    for b in (1, 2, 4):
        real = inputs(b, seed=100 + b)
        assert torch.allclose(graphs.run(b, **real), step(**real), rtol=1e-5, atol=1e-4)


def test_engine_decode_graphs_replay_equal_the_eager_engine(tmp_path):
    """FULL_DECODE_ONLY on CUDA: pure decode steps replay captured graphs (lazily, per batch bucket and
    context width); tokens equal and fp64 logits within 1e-10 of the same engine with --enforce-eager."""
    import numpy as np

    from engine import LLM, SamplingParams
    from engine.checkpoint.create import create_checkpoint

    ckpt = create_checkpoint("tiny", tmp_path / "tiny", seed=0, progress=False)
    settings = dict(device="cuda", dtype="float64", block_size=4, kda_chunk_size=8, max_num_seqs=8,
                    max_num_batched_tokens=512, cache_memory_bytes=8 << 20, snapshot_interval_blocks=2,
                    compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    prompts = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(1, 9), (2, 14), (3, 5), (4, 30)]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 10, 6, 10)]

    def run(**extra):
        llm = LLM(str(ckpt), **settings, **extra)
        runner = llm.engine.runner
        logits = record_step_logits(runner)
        tokens = [o.output.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        return tokens, logits, runner.decode_graphs

    ref_tokens, ref_logits, none = run(enforce_eager=True)
    assert none is None
    tokens, logits, graphs = run()
    assert graphs is not None and graphs.replay.graphs, "no graph was captured"
    assert sum(graphs.replays.values()) >= 8 and {s.rows for s in graphs.replays} >= {4, 2}
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=False)) < 1e-10
