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


def test_the_front_page_opens_with_the_two_commands_and_stays_short() -> None:
    """A reader on a fresh machine needs the install-and-start line and the test line first, and a front
    page, not a notebook: history belongs in docs/ and benchmarks/results/."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```bash\n") + len("```bash\n")
    assert text[start:text.index("```", start)].splitlines() == [
        "pip install torch==2.13.0 && pip install -e '.[dev]' && kimi-pd up",
        "python3 -m pytest -q tests",
    ]
    assert text.index("```bash") < text.index("\n## ")
    assert len(text.encode()) <= 16_000, "the README is a front page: move detail into docs/"


def test_read_next_links_every_document_in_docs() -> None:
    text = (ROOT / "README.md").read_text()
    read_next = text[text.index("## Read next"):]
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", read_next))
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - linked == set()
