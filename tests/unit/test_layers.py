"""The package's layers, as the guide's "how it works" names them, import downwards only.

cli -> bench -> daemon, engine -> wire -> core -> model; errors and logs import nothing of wcache, and
the package root holds only them and the package face. The test reads every module's imports (module
level and inside functions) with ast, so a lazy import cannot hide a loop.
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
    # The top: the command line runs the bench (`wcache bench`). The bench's engines are `wcache serve`
    # processes; it starts them (python -m wcache.cli, or start.py's boot line for the timed one) and
    # never imports the command line, so nothing points back up.
    "cli": {"cli", "bench", "daemon", "engine", "wire", "core", "model"},
    "bench": {"bench", "daemon", "engine", "wire", "core", "model"},
}
SHARED = {"errors", "logs", ""}  # "" is `from wcache import __version__`
ROOT = {"__init__.py", "errors.py", "logs.py"}  # the package face and what every layer uses


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
            if rel.name not in ROOT:
                problems.append(f"{rel}: a module in the package root (it holds only {sorted(ROOT)}; "
                                "a layer's module goes in its layer's package)")
            elif rel.name != "__init__.py" and imported_layers(path):
                problems.append(f"{rel}: {rel.name} must import nothing from wcache")
            continue
        if layer not in ALLOWED:
            problems.append(f"{rel}: package {layer!r} is in no layer (add it to ALLOWED)")
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


def test_the_daemon_launcher_imports_no_torch_nor_the_model():
    # `wcache preload`'s launcher plans and starts ranks; only a rank needs torch. Each replica of a
    # fan-out on a 2-core host paid about 2 s of CPU for a second import (docs/benchmarks.md).
    import subprocess
    import sys

    code = ("import sys, wcache.daemon.launcher; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'safetensors', 'numpy', 'tokenizers') or m == 'wcache.model.llama'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def module_imports(root: Path, package: str) -> dict[str, set[str]]:
    """For every module under ``root`` (the directory of ``package``): the package's modules it
    imports, at module level or inside functions. Importing ``a.b.c`` runs ``a.b``'s ``__init__``
    too, so a package's ``__init__`` counts as imported with each of its modules; ``from a.b import
    c`` imports the module ``a.b.c`` when there is one."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path

    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(modules)

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        edges = set().union(*(with_parents(t) for t in targets if t.startswith(package + "."))) if targets else set()
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another in a circle (Tarjan's strongly connected
    components of more than one module), sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycle_among_the_package_modules_lazy_imports_included():
    cycles = import_cycles(module_imports(PKG, "wcache"))
    assert not cycles, "modules that import one another:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_lazy_cycle_through_a_package_init(tmp_path):
    """The negative control: a loop closed by a function-level import, through a package's
    __init__, is found; the same modules without it are not a loop."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from toy import a\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from toy.b import g\n    return g\n")
    (pkg / "b.py").write_text("from toy.sub import c\n\ndef g():\n    pass\n")
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert import_cycles(module_imports(pkg, "toy")) == [["toy.a", "toy.b", "toy.sub"]]
    (pkg / "a.py").write_text("import os\n")
    assert import_cycles(module_imports(pkg, "toy")) == []


MAX_LINES = 600  # the project's rule: a module past it holds more than one concept; split it by role


def modules_over(root: Path, limit: int) -> list[str]:
    return sorted(f"{p.relative_to(root)}: {n} lines" for p in root.rglob("*.py")
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit)


def test_no_module_of_the_package_is_over_600_lines(tmp_path):
    assert not modules_over(PKG, MAX_LINES), "modules over the limit:\n" + "\n".join(modules_over(PKG, MAX_LINES))
    # The negative control: a module one line past the limit is named, one at it is not.
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "at_limit.py").write_text("x = 1\n" * MAX_LINES)
    assert modules_over(tmp_path, MAX_LINES) == [f"long.py: {MAX_LINES + 1} lines"]


# The engine's rooms, top to bottom (reference_impl/wcache/engine/__init__.py): a module imports its own
# room or the rooms below it, never one above; "serve" is engine/serve.py, the one-process start-up.
ENGINE_ROOMS = ["respawn", "serve", "api_server", "openai", "core", "worker", "loading"]
MAX_ENGINE_ROOT_MODULES = 12


def engine_room(path: Path) -> str:
    rel = path.relative_to(PKG / "engine")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def engine_arrows_up(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        room = engine_room(path) if root == PKG / "engine" else path.relative_to(root).parts[0]
        if room == "__init__":
            continue
        if room not in ENGINE_ROOMS:
            problems.append(f"engine/{path.relative_to(root)}: room {room!r} is not in ENGINE_ROOMS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module == "wcache.engine":
                names = [f"wcache.engine.{a.name}" for a in node.names]
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[:2] != ["wcache", "engine"] or len(parts) < 3:
                    continue
                target = parts[2]
                if target in ENGINE_ROOMS and ENGINE_ROOMS.index(target) < ENGINE_ROOMS.index(room):
                    problems.append(f"engine/{path.relative_to(root)}:{node.lineno}: {room} imports {target}, a room above it")
    return problems


def test_the_engines_rooms_import_downwards_only():
    problems = engine_arrows_up(PKG / "engine")
    assert not problems, "\n".join(problems)
    root_modules = [p.name for p in (PKG / "engine").glob("*.py") if p.name != "__init__.py"]
    assert len(root_modules) <= MAX_ENGINE_ROOT_MODULES, root_modules


def test_the_room_check_sees_an_arrow_up(tmp_path):
    """Negative control: a worker module that imports the API server is named."""
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "runner.py").write_text("from wcache.engine.api_server import server\n")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "engine.py").write_text("from wcache.engine.worker.runner import RankRunner\n")
    problems = engine_arrows_up(tmp_path)
    assert len(problems) == 1 and "worker imports api_server" in problems[0], problems
