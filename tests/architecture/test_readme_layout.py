"""The README's layout table matches the tree: every top-level folder and every engine subpackage has a
row, and every path a row names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index("| package | owns | why it sits there |")
    table = text[start:text.index("\n\n", start)]
    return [line.split("|")[1] for line in table.splitlines()[2:]]


def test_every_folder_has_a_row_and_every_named_path_exists() -> None:
    named = {p for cell in layout_rows() for p in re.findall(r"`([\w./*]+/[\w./*]*)`", cell)}   # paths: with a /
    folders = {f"{d.name}/" for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))
               and any(d.rglob("*.py")) and d.name not in ("build", "checkpoints", "logs")}
    engine = {f"engine/{d.name}/" for d in (ROOT / "engine").iterdir() if (d / "__init__.py").exists()}
    assert {f for f in folders if not any(n.startswith(f) for n in named)} == set()
    assert engine - named == set()
    for path in named:
        assert list(ROOT.glob(path.rstrip("/"))), f"the layout table names {path}, which does not exist"
