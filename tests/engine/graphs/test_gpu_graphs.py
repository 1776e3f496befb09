"""On a CUDA machine (the `device` tool): captured graphs replay == eager, engine tokens unchanged."""
from __future__ import annotations

import pytest
import torch

from engine.graphs.capture import StaticGraphs, graph_backend
from engine.model.kda_ops import causal_conv_step, kda_recurrent

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

    def inputs(b):
        gen = torch.Generator(device="cuda").manual_seed(b)
        r = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)   # noqa: E731
        return dict(x=r(b, c), conv=r(b, 3, c), q=r(b, 1, h, k), kk=r(b, 1, h, k), v=r(b, 1, h, k),
                    g=-r(b, 1, h, k).abs(), beta=r(b, 1, h).sigmoid(), state=r(b, h, k, k))

    graphs = StaticGraphs(backend, step, inputs, (1, 2, 4))
    for b in (1, 2, 4):
        real = inputs(100 + b)
        assert torch.allclose(graphs.run(b, **real), step(**real), rtol=1e-5, atol=1e-4)
