"""The guide's pages as the built site serves them (a plain module: test modules cannot import a
conftest by name, since every test directory has one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def page_paths() -> list[str]:
    """The URL path of every page of the guide (use_directory_urls is false: docs/foo.md -> foo.html)."""
    out = []
    for md in sorted(DOCS.rglob("*.md")):
        rel = md.relative_to(DOCS).with_suffix("")
        out.append("" if rel.name == "index" and rel.parent == Path(".") else f"{rel.as_posix()}.html")
    return out


def mermaid_count(path: str) -> int:
    """How many Mermaid diagrams the page at this URL path has in its Markdown."""
    md = DOCS / ("index.md" if not path else path.removesuffix(".html") + ".md")
    return len(re.findall(r"^\s*```mermaid\s*$", md.read_text(encoding="utf-8"), re.MULTILINE))


def page_markdown(path: str) -> str:
    return (DOCS / ("index.md" if not path else path.removesuffix(".html") + ".md")).read_text(encoding="utf-8")


def output_count(path: str) -> int:
    """How many expected-output blocks (``<!-- block: expect-output -->``) the page has."""
    return len(re.findall(r"^<!-- block: expect-output -->\s*$", page_markdown(path), re.MULTILINE))
