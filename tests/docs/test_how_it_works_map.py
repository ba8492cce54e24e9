"""docs/how-it-works.md's map of the code (its ``| Package | What it holds |`` table) names every
package of reference_impl/wcache/, subpackages included, and nothing the tree lacks: a package
added, moved or removed without its row fails here. The negative controls below show that the
comparison sees a difference either way."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reference_impl" / "wcache"
HEADER = "| Package | What it holds |"


def mapped_packages(page: str) -> list[str]:
    """The dotted package names of the map's first column, in the page's order."""
    lines = page.splitlines()
    start = lines.index(HEADER)  # ValueError: the page has no map
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first = line.strip("|").split("|")[0].strip()
        match = re.fullmatch(r"`(wcache(?:\.\w+)*)`", first)
        assert match, f"a row of the map whose first cell is not one `wcache.<package>`: {line!r}"
        names.append(match.group(1))
    return names


def tree_packages(package_dir: Path, name: str = "wcache") -> set[str]:
    """Every package under ``package_dir`` (a directory holding an __init__.py), dotted, the root left out."""
    return {".".join([name, *p.parent.relative_to(package_dir).parts]) for p in package_dir.rglob("__init__.py")
            if p.parent != package_dir and "__pycache__" not in p.parts}


def differences(mapped: list[str], tree: set[str]) -> list[str]:
    problems = [f"{n}: named twice in the map" for n in sorted({n for n in mapped if mapped.count(n) > 1})]
    problems += [f"{n}: a package of the tree that the map does not name" for n in sorted(tree - set(mapped))]
    problems += [f"{n}: named in the map, not a package of the tree" for n in sorted(set(mapped) - tree)]
    return problems


def test_the_map_names_every_package_of_the_tree_and_nothing_else():
    mapped = mapped_packages((ROOT / "docs" / "how-it-works.md").read_text(encoding="utf-8"))
    problems = differences(mapped, tree_packages(PACKAGE))
    assert not problems, "docs/how-it-works.md's map and reference_impl/wcache/ disagree:\n" + "\n".join(problems)


def test_a_subpackage_sits_below_its_package_in_the_map():
    # The map reads top-down by layer: a subpackage's row follows its package's (engine, then engine.loading).
    mapped = mapped_packages((ROOT / "docs" / "how-it-works.md").read_text(encoding="utf-8"))
    for i, name in enumerate(mapped):
        parent = name.rpartition(".")[0]
        if parent != "wcache":
            assert parent in mapped[:i], f"{name} comes before its package {parent} in the map"


def test_the_comparison_sees_a_package_missing_from_either_side(tmp_path):
    """Negative controls: a package the map forgets, and a row for a package that is gone."""
    for d in ("engine", "engine/front", "core"):
        (tmp_path / "wcache" / d).mkdir(parents=True)
        (tmp_path / "wcache" / d / "__init__.py").write_text("")
    (tmp_path / "wcache" / "__init__.py").write_text("")
    (tmp_path / "wcache" / "notes").mkdir()  # no __init__.py: not a package
    tree = tree_packages(tmp_path / "wcache")
    assert tree == {"wcache.engine", "wcache.engine.front", "wcache.core"}
    page = f"{HEADER}\n| --- | --- |\n| `wcache.engine` | the engine |\n| `wcache.core` | shared |\n| `wcache.wire` | gone |\n"
    assert differences(mapped_packages(page), tree) == [
        "wcache.engine.front: a package of the tree that the map does not name",
        "wcache.wire: named in the map, not a package of the tree",
    ]
    full = page.replace("| `wcache.wire` | gone |\n", "| `wcache.engine.front` | the HTTP side |\n")
    assert differences(mapped_packages(full), tree) == []
