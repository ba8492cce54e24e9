"""argparse's namespace stops at the command line ([arch-3]): below cli/, code takes typed settings
(core/settings.py's from_flags builds them once), never the parsed ``args``.

The check reads every module of the package with ast and names each reference to
``argparse.Namespace`` (an attribute, an import, a call) and each read of an ``args``
attribute (``args.port``, ``getattr(args, "port")``, ``vars(args)``). Allowed: cli/, which parses
the command line, and a program's own ``main`` that parses its own (``python -m wcache.bench.streaming``:
``main`` calls ``parse_args`` and reads what it parsed, as cli/ does). The name ``args`` is the
project's name for a parsed command line; a namespace under another name would pass, which review
catches where this cannot.
"""

from __future__ import annotations

import ast
from pathlib import Path

import wcache

PKG = Path(wcache.__file__).parent
ALLOWED_DIRS = {"cli"}  # the command line: it parses argv and builds each command's settings


def _parses_its_own_argv(fn: ast.FunctionDef) -> bool:
    return fn.name == "main" and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                                     and n.func.attr == "parse_args" for n in ast.walk(fn))


def _is_args(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "args"


def namespace_uses(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    allowed = set()  # nodes inside a main that parses its own argv
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and _parses_its_own_argv(fn):
            allowed |= {id(n) for n in ast.walk(fn)}
    found = []
    for n in ast.walk(tree):
        if id(n) in allowed:
            continue
        what = None
        if isinstance(n, ast.Attribute) and n.attr == "Namespace" and isinstance(n.value, ast.Name) \
                and n.value.id == "argparse":
            what = "argparse.Namespace"
        elif isinstance(n, ast.ImportFrom) and n.module == "argparse" and any(a.name == "Namespace" for a in n.names):
            what = "from argparse import Namespace"
        elif isinstance(n, ast.Attribute) and _is_args(n.value):
            what = f"args.{n.attr}"
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "vars", "hasattr") \
                and n.args and _is_args(n.args[0]):
            what = "vars(args)" if n.func.id == "vars" else f"{n.func.id}(args, ...)"
        if what:
            found.append(f"{rel}:{n.lineno}: {what}")
    return found


def namespace_uses_under(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ALLOWED_DIRS:
            continue
        found += namespace_uses(path, str(rel))
    return found


def test_no_module_outside_the_command_line_reads_the_parsed_namespace():
    found = namespace_uses_under(PKG)
    assert not found, ("the parsed command line below cli/ (take a settings dataclass: core/settings.py):\n"
                       + "\n".join(found))


def test_the_check_finds_a_planted_namespace(tmp_path):
    """The negative control: each way of reading the namespace is named, in a layer below cli/;
    the same code in cli/, and a program's main that parses its own argv, are not."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "cli").mkdir()
    (tmp_path / "engine" / "serve.py").write_text(
        "import argparse\n"
        "def run_serve(args):\n"
        "    return args.port\n"
        "def spare(spec):\n"
        "    return argparse.Namespace(**spec)\n"
        "def limits(args):\n"
        "    return getattr(args, 'max_concurrent_connections', 64), vars(args)\n")
    (tmp_path / "engine" / "core.py").write_text("from argparse import Namespace\n")
    (tmp_path / "engine" / "tool.py").write_text(
        "import argparse\n"
        "def main(argv=None):\n"
        "    args = argparse.ArgumentParser().parse_args(argv)\n"
        "    return args.model\n"
        "def helper(args):\n"
        "    return args.model\n")
    (tmp_path / "cli" / "__init__.py").write_text("def cmd(args):\n    return args.port, vars(args)\n")
    assert namespace_uses_under(tmp_path) == [
        "engine/core.py:1: from argparse import Namespace",
        "engine/serve.py:3: args.port",
        "engine/serve.py:5: argparse.Namespace",
        "engine/serve.py:7: getattr(args, ...)",
        "engine/serve.py:7: vars(args)",
        "engine/tool.py:6: args.model",
    ]
