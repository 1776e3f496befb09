"""The house's floors, checked on the source: every import in every module (lazy ones included, as
they run too) goes to its own package or a lower floor, and no set of modules imports itself round.

    shared                      ground floor: imports nothing else of the project
    engine, kv_transfer         the model + runtime; moving state
    worker                      the role-agnostic worker service (OpenAI server over the engine)
    prefill_worker, decode_worker   the roles (legs); router: the gateway (shared only)
    kimi_pd                     the command line and the one file naming every role
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED: dict[str, set[str]] = {
    "shared": set(),
    "engine": {"shared"},
    "kv_transfer": {"shared"},
    "worker": {"shared", "engine", "kv_transfer"},
    "prefill_worker": {"shared", "engine", "kv_transfer", "worker"},
    "decode_worker": {"shared", "engine", "kv_transfer", "worker"},
    "router": {"shared"},
    "kimi_pd": {"shared", "engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router"},
}
PROJECT = set(ALLOWED) | {"benchmarks", "tests"}


def _modules() -> dict[str, Path]:
    out = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports (exact modules: `from a import b` is `a.b` when that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m.split(".")[0] in PROJECT}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_every_import_goes_down_a_floor_or_stays_in_its_package(graph) -> None:
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() for dep in deps
                   if dep.split(".")[0] != mod.split(".")[0] and dep.split(".")[0] not in ALLOWED[mod.split(".")[0]])
    assert wrong == []


def test_router_and_shared_never_import_torch() -> None:
    modules = _modules()
    heavy = sorted(name for name, path in modules.items() if name.split(".")[0] in ("router", "shared")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   and any(n.split(".")[0] == "torch" for n in
                           ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])))
    assert heavy == []


def test_no_import_cycles(graph) -> None:
    """Tarjan's strongly connected components: any component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert cycles == []


def test_the_checker_sees_a_violation(tmp_path) -> None:
    """Guard against a checker that cannot fail: a module importing upward is reported."""
    bad = tmp_path / "m.py"
    bad.write_text("from worker.app import create_app\n\ndef f():\n    import engine.llm\n")
    assert imports_of(bad, _modules()) == {"worker.app", "engine.llm"}
