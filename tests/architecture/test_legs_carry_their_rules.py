"""The worker service names no role: a leg carries its own rules (whether it streams, the routes it
adds, the engine call handed in when it is built), and no leg imports the module that dispatched the
request to it (worker/legs.py), so a request's walk through a worker never climbs back up."""
from __future__ import annotations

import ast
from pathlib import Path

from decode_worker import ROLE as DECODE
from kimi_pd.roles import ROLES
from prefill_worker import ROLE as PREFILL
from tests.architecture.test_import_floors import _modules, imports_of

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"x" * 16


def test_no_leg_imports_the_dispatching_module() -> None:
    modules = _modules()
    legs = ("prefill_worker", "decode_worker")
    climbing = sorted(name for name, path in modules.items() if name.split(".")[0] in legs
                      and "worker.legs" in imports_of(path, modules))
    assert climbing == []


def test_the_worker_service_names_no_role() -> None:
    named = sorted(f"{path.name}:{node.lineno}" for path in (ROOT / "worker").glob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Constant) and node.value in ("prefill", "decode"))
    assert named == []


def test_legs_say_whether_they_stream_and_which_routes_they_add() -> None:
    assert [(path, kind) for path, kind, _ in PREFILL.routes(SECRET)] == [("/internal/kv/release", "prefill"),
                                                                             ("/internal/kv/renew", "prefill")]
    assert DECODE.routes(SECRET) == []
    assert ROLES["both"].routes(b"") == []                       # no transfers configured: no legs, no routes
    assert {leg.kind: leg.streams for role in ROLES.values() for leg in role.legs} == {"prefill": False,
                                                                                        "decode": True}
