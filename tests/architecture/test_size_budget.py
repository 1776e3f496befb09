"""The house's size budget, checked on the source of the library (not tests, not benchmarks): no function
or method over 60 lines and no module over 500 lines, so each stays readable in one sitting.

Measured with `ast`, not by eye:
* a function's length is `end_lineno - first + 1`, `first` being its first decorator's line (else the
  `def` line): decorators, signature, docstring, comments and blank lines inside the body all count. A
  nested function or class counts toward its enclosing function and is measured on its own as well.
* a module's length is its number of lines.

Anything over budget needs a named entry in `ALLOWED_OVER` (module path, or `path:qualname` for a
function) with the reason. The list may only shrink: an entry that is no longer over budget (or no
longer exists) fails the test too, so it is removed as soon as its code is split.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("shared", "router", "worker", "prefill_worker", "decode_worker", "kv_transfer", "engine", "kimi_pd")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500

ALLOWED_OVER: dict[str, str] = {}


def function_lengths(source: str) -> dict[str, int]:
    """Dotted qualname (`Class.method`, `outer.inner`) -> length in lines, for every function in `source`."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out[prefix + child.name] = child.end_lineno - first + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def measure() -> dict[str, int]:
    """Every library module (by path) and function (by `path:qualname`) -> its length in lines."""
    sizes: dict[str, int] = {}
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            source = path.read_text(encoding="utf-8")
            sizes[rel] = len(source.splitlines())
            sizes.update({f"{rel}:{name}": n for name, n in function_lengths(source).items()})
    return sizes


def _budget(key: str) -> int:
    return MAX_FUNCTION_LINES if ":" in key else MAX_MODULE_LINES


def test_the_measure_counts_decorators_docstrings_and_nesting():
    source = '''
import functools


@functools.cache
def decorated():
    """Docstring."""

    return 1


class Box:
    async def method(self):
        def inner():
            pass
        return inner
'''
    assert function_lengths(source) == {"decorated": 5, "Box.method": 4, "Box.method.inner": 2}


def test_no_function_or_module_over_budget():
    over = {key: n for key, n in measure().items() if n > _budget(key) and key not in ALLOWED_OVER}
    assert not over, (f"over budget (functions <= {MAX_FUNCTION_LINES} lines, modules <= {MAX_MODULE_LINES}): "
                      f"{over}; split them at a natural seam")


def test_the_allow_list_only_shrinks():
    sizes = measure()
    stale = {key: sizes.get(key) for key in ALLOWED_OVER if sizes.get(key, 0) <= _budget(key)}
    assert not stale, f"no longer over budget (or gone), remove from ALLOWED_OVER: {stale}"
