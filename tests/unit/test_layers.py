"""The package's layers, as the guide's "how it works" names them, import downwards only.

cli/bench -> daemon, engine -> wire -> core -> model; errors imports nothing of wcache. The test reads
every module's imports (module level and inside functions) with ast, so a lazy import cannot hide a loop.
"""

import ast
from pathlib import Path

import wcache

PKG = Path(wcache.__file__).parent
# What each layer may import, besides itself. Top-level helpers (errors, logs, the version) are open to all.
ALLOWED = {
    "model": {"model"},
    "core": {"core", "model"},
    "wire": {"wire", "core", "model"},
    "daemon": {"daemon", "wire", "core", "model"},
    "engine": {"engine", "wire", "core", "model"},
}
SHARED = {"errors", "logs", ""}  # "" is `from wcache import __version__`


def imported_layers(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "wcache" or name.startswith("wcache."):
                parts = name.split(".")
                found.add((parts[1] if len(parts) > 1 else "", node.lineno))
    return found


def test_no_relative_imports_and_layers_point_down():
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        layer = rel.parts[0] if len(rel.parts) > 1 else None
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)):
            problems.append(f"{rel}: relative import (the package uses absolute imports)")
        if layer is None:
            if rel.stem == "errors" and imported_layers(path):
                problems.append(f"{rel}: errors.py must import nothing from wcache")
            continue
        for target, line in imported_layers(path):
            if target not in ALLOWED[layer] and target not in SHARED:
                problems.append(f"{rel}:{line}: layer {layer!r} imports {target!r}")
    assert not problems, "\n".join(problems)


def test_the_wire_format_imports_no_torch():
    # Engines and tools that only speak the protocol should not pay for importing torch.
    import subprocess
    import sys

    code = "import sys, wcache.wire.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
