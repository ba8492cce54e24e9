"""docs/contributing.md's map of the code matches the package tree: every entry of the package root
and every module of cli/ and bench/ is named in it, and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reference_impl" / "wcache"
HEADING = "## How the code is laid out"


def code_map() -> str:
    text = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end if end >= 0 else None]


def rows() -> dict[str, str]:
    """The map's table: first cell (a path) -> second cell."""
    out = {}
    for line in code_map().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2:
            out[cells[0]] = cells[1]
    return out


def entries(directory: Path) -> set[str]:
    return {p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}


def test_every_root_entry_is_in_the_map_and_every_mapped_path_exists():
    table = rows()
    named = {name for cell in table for name in re.findall(r"`([^`]+)`", cell)}
    assert entries(PACKAGE) == named, f"in the tree, not in the map: {entries(PACKAGE) - named}; " \
                                      f"in the map, not in the tree: {named - entries(PACKAGE)}"


def test_every_module_of_cli_and_bench_is_named_in_its_row():
    table = rows()
    for package in ("cli", "bench"):
        row = table[f"`{package}/`"]
        named = set(re.findall(r"`(\w+\.py)`", row)) - {"__init__.py"}  # a package's face may go unnamed
        modules = entries(PACKAGE / package) - {"__init__.py"}
        assert named == modules, f"{package}/: in the tree, not in the map: {modules - named}; " \
                                 f"in the map, not in the tree: {named - modules}"
