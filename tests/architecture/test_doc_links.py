"""Every document the project names is in the project: `*.md` paths in code, tests and documents, and
the relative links (with their #anchors) of the README, docs/ and benchmarks/, resolve in this tree.
A reference to a note that lives elsewhere is a dead end for every reader of a clone."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("shared", "engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "kimi_pd",
             "tests", "benchmarks")
MD_PATH = re.compile(r"[\w./-]*\w\.md\b")            # bare, backticked or quoted: any token ending in .md
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")         # [text](target)
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def doc_files() -> list[Path]:
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")]
    return sorted(p for p in docs if p.is_file())


def resolves(name: str, source: Path) -> Path | None:
    """The file `name` points at, read from the source's folder or from the repository root."""
    for base in (source.parent, ROOT):
        path = (base / name).resolve()
        if path.is_file() and path.is_relative_to(ROOT):
            return path
    return None


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)     # no headings in code blocks
    return {github_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}


def dead_md_paths(path: Path) -> list[str]:
    text = LINK.sub(r" \1 ", URL.sub("", path.read_text()))    # a link's text is a label; its target is the path
    return sorted({name for name in MD_PATH.findall(text) if resolves(name, path) is None})


def dead_links(path: Path) -> list[str]:
    dead = []
    for target in LINK.findall(URL.sub("", path.read_text())):
        if target.startswith(("mailto:", "<")):
            continue
        name, _, fragment = target.partition("#")
        file = resolves(name, path) if name else path
        if file is None or (fragment and file.suffix == ".md" and fragment not in anchors(file)):
            dead.append(target)
    return dead


@pytest.mark.parametrize("path", code_files() + doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_md_file_exists(path: Path) -> None:
    assert dead_md_paths(path) == [], f"{path.relative_to(ROOT)} names documents that are not in the tree"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    assert dead_links(path) == [], f"{path.relative_to(ROOT)} links to files or headings that do not exist"


def test_the_checks_see_a_dead_reference(tmp_path: Path) -> None:
    """The two checks fail on what they exist to catch: a note outside the tree and a missing anchor."""
    md = ".md"                                   # spelt apart, so this file names no missing document itself
    doc = ROOT / "docs" / f"design{md}"
    assert resolves(f"docs/design{md}", ROOT / "engine" / "model" / "kda.py") == doc
    assert resolves(f"NOTES-NOT-IN-TREE{md}", doc) is None
    assert "request-path" in anchors(doc) and github_slug("The P/D protocol: `kv_transfer_params`") == \
        "the-pd-protocol-kv_transfer_params"
    probe = tmp_path / f"probe{md}"
    probe.write_text(f"See MODEL{md} section 3, [design](docs/design{md}#no-such-heading) and [x](missing{md}).\n")
    assert dead_md_paths(probe) == [f"MODEL{md}", f"missing{md}"]
    assert dead_links(probe) == [f"docs/design{md}#no-such-heading", f"missing{md}"]
