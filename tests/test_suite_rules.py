"""Rules of the suite itself: a test of the project's own code never skips because that code fails
to import (a broken module would then look like a missing optional dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def own_module_skips(source: str) -> list[str]:
    """``pytest.importorskip("wcache...")`` calls in a test source: the project's module, skipped on error."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "importorskip" \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).split(".")[0] == "wcache":
            out.append(f"line {node.lineno}: importorskip({node.args[0].value!r})")
    return out


def test_no_test_skips_when_the_projects_own_module_fails_to_import():
    found = {str(p.relative_to(TESTS)): own_module_skips(p.read_text(encoding="utf-8")) for p in TESTS.rglob("*.py")}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"import the project's modules plainly (an import error must fail): {found}"


def test_the_rule_finds_an_importorskip_of_the_project():
    """Negative control: the check sees the pattern it forbids, and leaves optional packages alone."""
    assert own_module_skips('autotune = pytest.importorskip("wcache.core.autotune", reason="x")\n')
    assert own_module_skips('from pytest import importorskip\nimportorskip("wcache")\n')
    assert not own_module_skips('kv = pytest.importorskip("kubernetes_validate")\n')
