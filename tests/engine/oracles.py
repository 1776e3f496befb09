"""Independent references for the model tests: fla-core's naive functions, loaded by file path.

fla-core's package `__init__` imports Triton kernels, which CPU machines lack, so the oracles are
loaded from their files (`naive.py` needs only torch + einops). `gate.py` imports Triton at the top,
so its two pure-torch reference functions are extracted with `ast` and compiled alone.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F


def fla_root() -> Path | None:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fla_kda_naive() -> ModuleType:
    return _load_file(fla_root() / "ops" / "kda" / "naive.py", "fla_kda_naive")


def fla_attnres_naive() -> ModuleType:
    return _load_file(fla_root() / "ops" / "attnres" / "naive.py", "fla_attnres_naive")


def fla_gate_functions() -> dict[str, object]:
    source = (fla_root() / "ops" / "kda" / "gate.py").read_text()
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    tree = ast.parse(source)
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace: dict[str, object] = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=body, type_ignores=[]), "fla_gate_naive", "exec"), namespace)
    return {name: namespace[name] for name in wanted}


def kda_float64_loop(q, k, v, g, beta, state, scale):
    """The recurrence of docs/model.md, KDA, one head and one token at a time, in float64.

    q, k: [T, H, K] (already l2-normalised), v: [T, H, V], g: [T, H, K], beta: [T, H], state: [H, K, V].
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    s = state.double().clone()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] = torch.diag(g[t, h].exp()) @ s[h]
            s[h] = s[h] + beta[t, h] * torch.outer(k[t, h], v[t, h] - s[h].T @ k[t, h])
            out[t, h] = s[h].T @ (q[t, h] * scale)
    return out, s
