"""Device graphs behind one interface: CUDA graphs (`torch.cuda.graphs`), NPU graphs (torch-npu's
`torch.npu.NPUGraph`), none elsewhere. `StaticGraphs` captures a function of fixed-shape tensors once
per bucket and replays it after copying the real inputs into the captured buffers."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphBackend:
    name: str
    graph_class: Any                # CUDAGraph / NPUGraph
    graph_context: Any              # torch.cuda.graph / torch.npu.graph
    pool_handle: Callable[[], Any]
    synchronize: Callable[[], None]
    stream: Callable[[], Any]
    stream_context: Callable[[Any], Any]


def graph_backend(device: str | torch.device) -> GraphBackend | None:
    """The graph API of `device`, or None (CPU, or an accelerator without graph support here)."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        return GraphBackend("cuda", torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle,
                            torch.cuda.synchronize, torch.cuda.Stream, torch.cuda.stream)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            return None
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "NPUGraph"):
            return GraphBackend("npu", npu.NPUGraph, npu.graph, npu.graph_pool_handle, npu.synchronize,
                                npu.Stream, npu.stream)
    return None


class StaticGraphs:
    """`fn(**inputs) -> Tensor` captured per key (a batch-size bucket, or any hashable shape key) over
    static input buffers.

    `make_inputs(key)` builds example inputs of that key's shapes (their values are only used for
    warm-up and capture); keys in `sizes` are captured now, largest first (smaller graphs reuse its
    memory pool), any other on its first `run`. `run(key, **inputs)` copies inputs of exactly that key's
    shapes in and replays. The output is the captured buffer: copy it before the next replay if it must
    survive.
    """

    def __init__(self, backend: GraphBackend, fn: Callable[..., torch.Tensor],
                 make_inputs: Callable[[Any], dict[str, torch.Tensor]], sizes: tuple = (), warmup: int = 2) -> None:
        self.backend, self.fn, self.make_inputs, self.warmup = backend, fn, make_inputs, warmup
        self.graphs: dict[Any, tuple[Any, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.pool = backend.pool_handle()
        for key in sorted(sizes, reverse=True):
            self.capture(key)
        if sizes:
            log.info("captured %s graphs for %s", backend.name, sorted(self.graphs))

    def capture(self, key: Any) -> None:
        backend, inputs = self.backend, self.make_inputs(key)
        side = backend.stream()
        with backend.stream_context(side):
            for _ in range(self.warmup):
                self.fn(**inputs)
        backend.synchronize()
        graph = backend.graph_class()
        with backend.graph_context(graph, pool=self.pool):
            out = self.fn(**inputs)
        self.graphs[key] = (graph, inputs, out)
        log.info("captured a %s graph for %s", backend.name, key)

    def run(self, key: Any, **inputs: torch.Tensor) -> torch.Tensor:
        if key not in self.graphs:
            self.capture(key)
        graph, static, out = self.graphs[key]
        for name, value in inputs.items():
            static[name].copy_(value)
        graph.replay()
        return out
