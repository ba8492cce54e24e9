"""The guide's tables are tied to the code and to the published measurements.

* Daemon flag table (docs/configuration.md) == ``wcache preload``'s argparse options: names,
  defaults and help.
* Loader key table == ``wcache.engine.loading.config.LOADER_KEYS``: names and defaults.
* Cache key table (docs/how-it-works.md) == ``wcache.core.fingerprint.KEY_FIELDS``.
* Environment variable table == the ``WCACHE_*`` variables the package reads.
* Every generated region (tools/doc_tables.py) and the benchmark SVG (tools/plot_bench.py) equal a
  fresh render from the code and from docs/benchmarks/*.json.
* Every message quoted in docs/troubleshooting.md is one of the code's message templates, and a test
  (or a block of the guide that CI runs against real processes) produces it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import bench_records
import doc_tables
import gpu_logs
import matrix_tables
import plot_bench
import pytest
import respawn_tables
import seed_tables
from tools.docs_runner.parse import extract_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "reference_impl" / "wcache"
TESTS = ROOT / "tests"

# --------------------------------------------------------------------------------------------
# Markdown tables
# --------------------------------------------------------------------------------------------


def split_row(line: str) -> list[str]:
    """Cells of one table row; a `|` inside a code span or escaped as `\\|` is not a separator."""
    cells, cur, i, ticks = [], "", 0, 0
    body = line.strip()
    body = body.removeprefix("|")
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    while i < len(body):
        ch = body[i]
        if ch == "`":
            n = len(body[i:]) - len(body[i:].lstrip("`"))
            ticks = 0 if ticks == n else (n if ticks == 0 else ticks)
            cur += "`" * n
            i += n
            continue
        if ch == "\\" and body[i + 1 : i + 2] == "|":
            cur += "\\|"
            i += 2
            continue
        if ch == "|" and not ticks:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    cells.append(cur.strip())
    return cells


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, rows) of every pipe table in a page."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and re.match(r"^\s*\|?\s*:?-{3,}", lines[i + 1]):
            header, rows, j = split_row(lines[i]), [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(split_row(lines[j]))
                j += 1
            out.append((header, rows))
            i = j
        else:
            i += 1
    return out


def code_spans(cell: str) -> list[str]:
    """The contents of the code spans of a cell (`` `x` `` and ``` ``x`` ```)."""
    return [m.group(2).strip() if m.group(1) == "``" else m.group(2)
            for m in re.finditer(r"(`+)(.+?)\1", cell)]


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_table_parser_handles_code_spans_and_escapes():
    assert split_row("| `a|b` | c \\| d | ``x `y` z`` |") == ["`a|b`", "c \\| d", "``x `y` z``"]
    assert code_spans("`a` and ``b `c` d``") == ["a", "b `c` d"]
    [(header, rows)] = tables("x\n\n| A | B |\n| --- | ---: |\n| 1 | 2 |\n| 3 | 4 |\n\ny")
    assert header == ["A", "B"] and rows == [["1", "2"], ["3", "4"]]


# --------------------------------------------------------------------------------------------
# Daemon flags and loader keys
# --------------------------------------------------------------------------------------------


def flag_rows(text: str) -> dict[frozenset, tuple[str, str]]:
    """{option strings: (default cell, description cell)} of every flag table of a page."""
    rows = {}
    for header, body in tables(text):
        if header[:1] == ["Flag"] and "Default" in header:
            d, h = header.index("Default"), header.index("Description")
            for r in body:
                names = frozenset(code_spans(r[0]))
                assert names not in rows, f"flag listed twice: {sorted(names)}"
                rows[names] = (r[d], r[h])
    return rows


def default_of_cell(cell: str, action: argparse.Action):
    """What a Default cell says, as a value to compare with the action's."""
    if cell == "required":
        return "required"
    if cell == "not set":
        return None
    if cell in ("on", "off"):
        return cell == "on"
    spans = code_spans(cell)
    assert len(spans) == 1, f"default cell {cell!r} is neither a keyword nor one code span"
    return spans[0]


def compare_flags(text: str, command: str = "preload") -> list[str]:
    problems = []
    rows = flag_rows(text)
    actions = doc_tables.command_actions(command)
    for a in actions:
        names = frozenset(a.option_strings)
        if names not in rows:
            problems.append(f"missing from the table: {'/'.join(a.option_strings)}")
            continue
        cell, help_cell = rows.pop(names)
        want = "required" if a.required else (a.default if a.default is None or isinstance(a.default, bool)
                                             else str(a.default))
        got = default_of_cell(cell, a)
        if got != want:
            problems.append(f"{'/'.join(a.option_strings)}: the table says default {cell!r}, argparse has {a.default!r}")
        if doc_tables.unformat_help(help_cell) != (a.help or ""):
            problems.append(f"{'/'.join(a.option_strings)}: description {help_cell!r} is not the help {a.help!r}")
    problems += [f"not an option of wcache {command}: {'/'.join(sorted(n))}" for n in rows]
    return problems


def test_daemon_flag_table_is_every_preload_option_with_its_default():
    problems = compare_flags(page("configuration.md"))
    assert not problems, "\n".join(problems) + "\nregenerate: python tools/doc_tables.py"
    assert len(flag_rows(page("configuration.md"))) == len(doc_tables.preload_actions()) > 20


def test_serve_reference_is_every_serve_option_with_its_default():
    text = page("serve-reference.md")
    problems = compare_flags(text, "serve")
    assert not problems, "\n".join(problems) + "\nregenerate: python tools/doc_tables.py"
    assert len(flag_rows(text)) == len(doc_tables.command_actions("serve")) > 15
    # The serve-only flags are there, and no daemon flag leaked in.
    rows = {n for names in flag_rows(text) for n in names}
    assert {"--port", "--model-loader-extra-config", "--gpu-memory-utilization"} <= rows
    assert not any(n.startswith("--weight-cache-") for n in rows)
    bad = text.replace("| `--port` | `PORT` | `8000` |", "| `--port` | `PORT` | `8080` |")
    assert "--port: the table says default '`8080`'" in "\n".join(compare_flags(bad, "serve"))


def test_the_flag_check_catches_a_wrong_default_a_missing_and_an_extra_flag():
    text = page("configuration.md")
    bad = text.replace("| `--weight-cache-health-host` | `HOST` | `0.0.0.0` |",
                       "| `--weight-cache-health-host` | `HOST` | `127.0.0.1` |")
    bad = re.sub(r"^\| `--nnodes` .*\n", "", bad, flags=re.MULTILINE)
    bad = bad.replace("| `--revision` |", "| `--revision`, `--rev` |")
    problems = "\n".join(compare_flags(bad))
    assert "--weight-cache-health-host: the table says default '`127.0.0.1`'" in problems
    assert "missing from the table: --nnodes" in problems
    assert "not an option of wcache preload: --rev/--revision" in problems


def loader_rows(text: str) -> dict[str, str]:
    for header, body in tables(text):
        if header[:2] == ["Key", "Default"]:
            return {code_spans(r[0])[0]: r[1] for r in body}
    raise AssertionError("no loader key table (| Key | Default | ...) on the page")


def test_loader_key_table_is_loader_keys_with_their_defaults():
    from wcache.engine.loading.config import LOADER_KEYS

    rows = loader_rows(page("configuration.md"))
    assert set(rows) == set(LOADER_KEYS), f"table {sorted(rows)} != LOADER_KEYS {sorted(LOADER_KEYS)}"
    for key, cell in rows.items():
        (literal,) = code_spans(cell)
        value = json.loads(literal)
        want = LOADER_KEYS[key]
        assert value == want and type(value) is type(want), f"{key}: table default {literal}, code {want!r}"
    assert "transport" in rows  # wcache's own key, beside upstream's six


def test_cache_key_table_lists_every_key_field():
    from wcache.core.fingerprint import KEY_FIELDS

    for header, body in tables(page("how-it-works.md")):
        if header[:1] == ["Field"]:
            listed = [f for r in body for f in code_spans(r[0])]
            assert sorted(listed) == sorted(KEY_FIELDS)
            return
    raise AssertionError("no cache key table (| Field | ...) in how-it-works.md")


def package_env_vars() -> set[str]:
    """WCACHE_* names the package reads (internal process specs and a rank's pipes excluded)."""
    names = set()
    for f in PACKAGE.rglob("*.py"):  # the package has subpackages
        names |= set(re.findall(r"[\"'](WCACHE_[A-Z0-9_]+)[\"']", f.read_text(encoding="utf-8")))
    return {n for n in names if not n.endswith("_SPEC") and not n.startswith("WCACHE_PIPED_")}


def test_environment_variable_table_is_what_the_package_reads():
    for header, body in tables(page("configuration.md")):
        if header[:1] == ["Variable"]:
            listed = {code_spans(r[0])[0] for r in body}
            assert {v for v in listed if v.startswith("WCACHE_")} == package_env_vars()
            assert "TMPDIR" in listed
            return
    raise AssertionError("no environment variable table in configuration.md")


# --------------------------------------------------------------------------------------------
# Generated regions and the benchmark chart
# --------------------------------------------------------------------------------------------


def test_generated_regions_equal_a_fresh_render():
    stale = doc_tables.stale()
    assert not stale, "stale generated regions (run python tools/doc_tables.py):\n" + "\n".join(stale)
    used = {name for p in doc_tables.guide_pages() for name, _ in doc_tables.regions(p.read_text(encoding="utf-8"))}
    assert used == set(doc_tables.GENERATORS), f"generators without a region: {set(doc_tables.GENERATORS) - used}"


def test_a_changed_table_is_reported_stale(tmp_path):
    text = page("benchmarks.md")
    bad = tmp_path / "benchmarks.md"
    bad.write_text(text.replace("| llama-8b |", "| llama-8b (typed by hand) |", 1), encoding="utf-8")
    assert doc_tables.stale([bad]) and not doc_tables.stale([DOCS / "benchmarks.md"])


def test_benchmark_svg_regenerates_identically_from_the_json():
    assert plot_bench.SVG_PATH.read_text(encoding="utf-8") == plot_bench.render_svg()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_bench.py"), "--check"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    import xml.etree.ElementTree as ET

    svg = ET.fromstring(plot_bench.SVG_PATH.read_text(encoding="utf-8"))
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    fresh = bench_records.fresh_records()
    assert fresh, "the chart shows the fresh-process records, and there are some"
    for path, record in fresh:
        assert bench_records.run_label(path) in texts
        for source in ("disk", "zero_copy", "copy"):
            assert bench_records.fmt_seconds(record["seconds"][source]) in texts
    assert (DOCS / "benchmarks.md").read_text(encoding="utf-8").count("benchmarks/restart-h200.svg") == 1


def test_the_chart_title_says_how_its_records_were_sampled_and_no_label_is_clipped():
    """The title once said "after an engine restart" over in-process records, and "10,005 tensors"
    ran off the chart's left edge as ".0,005 tensors"."""
    import xml.etree.ElementTree as ET

    svg = ET.fromstring(plot_bench.SVG_PATH.read_text(encoding="utf-8"))
    ns = "{http://www.w3.org/2000/svg}"
    title = svg.find(f"{ns}title").text
    assert "each sample a fresh process" in title and all(bench_records.fresh(d) for _, d in bench_records.fresh_records())
    width = float(svg.get("width"))
    for t in svg.iter(f"{ns}text"):
        x, n = float(t.get("x")), len(t.text) * plot_bench.CHAR_W * (float(t.get("font-size", 12)) / 12)
        left, right = {"end": (x - n, x), "middle": (x - n / 2, x + n / 2)}.get(t.get("text-anchor"), (x, x + n))
        assert 0 <= left and right <= width, (t.text, left, right, width)


def test_every_published_record_is_rendered():
    records = sorted(p.name for p in bench_records.BENCH_DIR.glob("*.json"))
    shown = {p.name for p, _ in bench_records.bench_records()} | {p.name for p, _ in matrix_tables.matrix_records()}
    shown |= {p.name for p, _ in doc_tables.streaming_records()}
    shown |= {p.name for p, _ in respawn_tables.respawn_records()}
    shown |= {p.name for p, _ in seed_tables.seed_records()}
    assert records and set(records) == shown
    logs = gpu_logs.gpu_test_logs()
    assert logs and all(log.name in page("validation.md") for log in logs)


# --------------------------------------------------------------------------------------------
# Troubleshooting messages
# --------------------------------------------------------------------------------------------

STAR = None  # a wildcard token: any text
MIN_LITERAL = 12  # a template or a quoted text needs a literal run at least this long
_PLACEHOLDER = re.compile(r"\{[^{}]*\}|%[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[sdifrxXeEgGc]")


def tokens(text: str, doc: bool) -> tuple:
    """Characters and STARs. In the code: {field} and %-formats; in the guide also `...`."""
    pattern = re.compile(r"\.\.\.|" + _PLACEHOLDER.pattern) if doc else _PLACEHOLDER
    out: list = []
    pos = 0
    for m in pattern.finditer(text):
        out += list(text[pos : m.start()])
        if not out or out[-1] is not STAR:
            out.append(STAR)
        pos = m.end()
    out += list(text[pos:])
    return tuple(out)


def literal_runs(toks: tuple) -> list[str]:
    runs, cur = [], ""
    for t in toks:
        if t is STAR:
            runs.append(cur)
            cur = ""
        else:
            cur += t
    return [r for r in runs + [cur] if r]


def shingles(toks: tuple, n: int = MIN_LITERAL) -> set[str]:
    return {r[i : i + n] for r in literal_runs(toks) for i in range(len(r) - n + 1)}


def intersects(a: tuple, b: tuple) -> bool:
    """Whether two patterns of characters and STARs match at least one common string."""
    n, m = len(a), len(b)
    nxt = [False] * (m + 1)
    nxt[m] = True  # row i = n: only STARs left in b can match the empty rest of a
    for j in range(m - 1, -1, -1):
        nxt[j] = b[j] is STAR and nxt[j + 1]
    for i in range(n - 1, -1, -1):
        cur = [False] * (m + 1)
        cur[m] = a[i] is STAR and nxt[m]
        for j in range(m - 1, -1, -1):
            if a[i] is STAR:
                cur[j] = nxt[j] or cur[j + 1]
            elif b[j] is STAR:
                cur[j] = cur[j + 1] or nxt[j]
            else:
                cur[j] = a[i] == b[j] and nxt[j + 1]
        nxt = cur
    return nxt[0]


class Template:
    def __init__(self, text: str, symbols: tuple[str, ...], where: str):
        self.text, self.symbols, self.where = text, symbols, where
        self.toks = tokens(text, doc=False)
        self.shingles = shingles(self.toks)


def _symbol(node: ast.AST, parents: dict, key: str | None = None) -> str | None:
    """NAME, Class.NAME or NAME["key"] for a string assigned to a name (or a dict under one)."""
    parent = parents.get(node)
    if isinstance(parent, ast.Dict):
        i = next((i for i, v in enumerate(parent.values) if v is node), None)
        k = parent.keys[i] if i is not None else None
        if isinstance(k, ast.Constant) and isinstance(k.value, str):
            base = _symbol(parent, parents)
            return f'{base}["{k.value}"]' if base else None
        return None
    if isinstance(parent, (ast.Assign, ast.AnnAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            owner = parents.get(parent)
            name = targets[0].id
            return f"{owner.name}.{name}" if isinstance(owner, ast.ClassDef) else name
    return None


@lru_cache(maxsize=1)
def templates() -> tuple[Template, ...]:
    """Every message-like string of the package: constants (not docstrings) and f-strings, plus
    each template with a ``{reason}`` combined with every REASONS text."""
    found: list[Template] = []
    for f in sorted(PACKAGE.rglob("*.py")):  # subpackages included
        tree = ast.parse(f.read_text(encoding="utf-8"))
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parent = parents.get(node)
                if isinstance(parent, (ast.Expr, ast.JoinedStr)):
                    continue  # docstrings; f-string parts are handled below
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            else:
                continue
            sym = _symbol(node, parents)
            found.append(Template(text, (sym,) if sym else (), f"{f.name}:{node.lineno}"))
    reasons = [t for t in found if t.symbols and re.match(r"^\w*REASONS\[", t.symbols[0])]
    for t in [t for t in found if "{reason}" in t.text]:
        for r in reasons:
            found.append(Template(t.text.replace("{reason}", r.text), t.symbols + r.symbols, t.where))
    return tuple(t for t in found if any(len(run) >= MIN_LITERAL for run in literal_runs(t.toks)))


def matching_templates(text: str) -> list[Template]:
    toks = tokens(text, doc=True)
    mine = shingles(toks)
    return [t for t in templates() if mine & t.shingles and intersects(toks, t.toks)]


def troubleshooting_texts() -> list[str]:
    """Every code span in the first column of every table of the troubleshooting page."""
    texts = []
    for header, rows in tables(page("troubleshooting.md")):
        for r in rows:
            texts += code_spans(r[0])
    return texts


def test_the_matcher_needs_every_literal_part_and_accepts_wildcards_on_both_sides():
    assert intersects(tokens("Waiting up to 300.0s for the weight cache", True),
                      tokens("Waiting up to {timeout}s for the weight cache", False))
    assert intersects(tokens("Externally held (...) exceed ...", True), tokens("Externally held ({x}) exceed ({y})", False))
    assert not intersects(tokens("Weights were freed", True), tokens("Weights were released", False))
    assert not intersects(tokens("no daemon socket found at {path}", True), tokens("no daemon socket at {path}", False))
    assert intersects(tokens("no daemon socket at ...", True), tokens("no daemon socket at {path}", False))
    assert matching_templates("Weight cache unusable (Weights were released); falling back to disk loading")
    assert not matching_templates("Weight cache unusable because the moon is full")


def test_troubleshooting_messages_are_the_codes_texts():
    texts = troubleshooting_texts()
    assert len(texts) >= 30, texts
    unknown = [t for t in texts if not matching_templates(t)]
    assert not unknown, "quoted in docs/troubleshooting.md but no template in reference_impl/wcache matches:\n" + \
        "\n".join(unknown)


# What a test asserts appears. Only these count as a test producing a message: an operand of an
# assert (``in``, ``==``, a truth test, a call in it), ``pytest.raises(match=...)``, the predicate
# of a poller that fails when it never holds (POLLERS), and an argument that a helper of the tests
# asserts (found the same way: ``check(code, out, message)`` asserts ``message in out``). An
# import, a comment, a ``not in`` / ``!=`` assertion (the message must NOT appear) and a comparison
# of literals with literals do not. A name counts through what it was bound to in its function or
# at module level (an assignment, a ``for`` target, a ``parametrize`` argument).
NEGATIVE_OPS = (ast.NotIn, ast.NotEq, ast.IsNot)
POLLERS = {"wait_until", "wait_for"}  # tests/procs.py: raise AssertionError when the predicate never holds
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Asserted:
    """The string literals, template names and plain names in the positive assertions of tests."""
    strings: list[str] = field(default_factory=list)
    symbols: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)

    def add(self, other: "Asserted") -> None:
        self.strings += other.strings
        self.symbols |= other.symbols
        self.names |= other.names


def _symbol_of(node: ast.AST) -> str | None:
    """``NAME``, ``Class.NAME`` (the last two parts of an attribute chain) or ``NAME["key"]``."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        base = _symbol_of(node.value)
        return f'{base.split(".")[-1]}["{node.slice.value}"]' if base else None
    if isinstance(node, ast.Attribute):
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
        return f"{owner}.{node.attr}" if owner else node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _constant_only(node: ast.AST) -> bool:
    """An expression made of literals only (a test comparing it proves nothing about the code)."""
    return all(isinstance(n, (ast.Constant, ast.JoinedStr, ast.FormattedValue, ast.Tuple, ast.List, ast.BinOp,
                              ast.operator, ast.expr_context))
               for n in ast.walk(node))


def _bindings(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """What each name of a function (or of a module, outside its functions) was bound to."""
    if isinstance(scope, ast.Module):
        nodes = [n for stmt in scope.body if not isinstance(stmt, (*FUNCTIONS, ast.ClassDef)) for n in ast.walk(stmt)]
    else:
        nodes = list(ast.walk(scope))
    out: dict[str, list[ast.AST]] = {}
    for n in nodes:
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets, value = (n.targets if isinstance(n, ast.Assign) else [n.target]), n.value
        elif isinstance(n, (ast.For, ast.comprehension)):
            targets, value = [n.target], n.iter
        elif isinstance(n, ast.NamedExpr):
            targets, value = [n.target], n.value
        else:
            continue
        for t in targets:
            for name in ast.walk(t):
                if isinstance(name, ast.Name):
                    out.setdefault(name.id, []).append(value)
    for deco in getattr(scope, "decorator_list", []):  # @pytest.mark.parametrize("a, b", [...])
        if isinstance(deco, ast.Call) and _symbol_of(deco.func) == "mark.parametrize" and len(deco.args) >= 2 \
                and isinstance(deco.args[0], ast.Constant):
            for name in re.split(r"[,\s]+", str(deco.args[0].value)):
                if name:
                    out.setdefault(name, []).append(deco.args[1])
    return out


def _params(fn: ast.AST) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return names[1:] if names[:1] == ["self"] else names


class _Scan:
    """What the positive assertions of one scope (a function, or a module's top level) mention.
    ``helpers``: function name -> the parameters it asserts appear (see the comment above)."""

    def __init__(self, scope: ast.AST, bindings: dict, helpers: dict[str, set[str]]):
        self.bindings, self.helpers, self.found = bindings, helpers, Asserted()
        body = scope.body if isinstance(scope, ast.Module) else [scope]
        for stmt in body:
            for node in self._walk(stmt, scope):
                if isinstance(node, ast.Assert):
                    self._positive(node.test, set())
                elif isinstance(node, ast.Call):
                    self._call(node)

    @staticmethod
    def _walk(node: ast.AST, scope: ast.AST):
        """ast.walk, without descending into nested functions and classes (their own scopes)."""
        todo = [node]
        while todo:
            n = todo.pop()
            if n is not scope and isinstance(n, (*FUNCTIONS, ast.ClassDef)):
                continue
            yield n
            todo.extend(ast.iter_child_nodes(n))

    def _call(self, node: ast.Call) -> None:
        name = (_symbol_of(node.func) or "").split(".")[-1]
        if name == "raises":
            for kw in node.keywords:
                if kw.arg == "match":
                    self._mentions(kw.value, set())
        if name in POLLERS and node.args and isinstance(node.args[0], ast.Lambda):
            self._positive(node.args[0].body, set())
        if name in self.helpers:
            params = self.helpers[name]
            for i, arg in enumerate(node.args):
                if ("#", i) in params:
                    self._mentions(arg, set())
            for kw in node.keywords:
                if kw.arg in params:
                    self._mentions(kw.value, set())

    def _positive(self, node: ast.AST, seen: set) -> None:
        """An asserted expression: everything in it counts but negated comparisons, ``not`` and
        one side of an ``or``."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            return
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                self._positive(v, seen)
            return
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(op, NEGATIVE_OPS) for op in node.ops) or all(_constant_only(o) for o in operands):
                return
            for o in operands:
                self._mentions(o, seen)
            return
        self._mentions(node, seen)

    def _mentions(self, node: ast.AST, seen: set) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                self.found.strings.append(n.value)
            sym = _symbol_of(n) if isinstance(n, (ast.Subscript, ast.Attribute, ast.Name)) else None
            if sym:
                self.found.symbols |= {sym, sym.split(".")[-1]}
            if isinstance(n, ast.Name):
                self.found.names.add(n.id)
                if n.id in self.bindings and n.id not in seen:
                    for value in self.bindings[n.id]:
                        self._mentions(value, seen | {n.id})


def _scopes(tree: ast.Module):
    """(scope, its bindings, module bindings included) for a module's top level and each function."""
    module = _bindings(tree)
    yield tree, module
    for fn in (n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)):
        yield fn, {**module, **_bindings(fn)}


def assertion_helpers(trees: list[ast.Module]) -> dict[str, set]:
    """Functions of the tests that assert one of their parameters appears, by name, with those
    parameters (by name and as ("#", position)). A name defined twice must assert the same ones."""
    helpers: dict[str, set] = {}
    for _ in range(3):  # helpers that call helpers
        found: dict[str, set] = {}
        for tree in trees:
            for fn, bindings in _scopes(tree):
                if isinstance(fn, ast.Module) or fn.name.startswith("test_"):
                    continue
                params = _params(fn)
                names = _Scan(fn, {k: v for k, v in bindings.items() if k not in params}, helpers).found.names
                mine = {p for p in params if p in names} | {("#", i) for i, p in enumerate(params) if p in names}
                found[fn.name] = found[fn.name] & mine if fn.name in found else mine
        helpers = {k: v for k, v in found.items() if v}
    return helpers


def asserted_in(sources: list[str]) -> Asserted:
    """What the positive assertions of these test modules mention (see the comment above)."""
    trees = [ast.parse(s) for s in sources]
    helpers = assertion_helpers(trees)
    found = Asserted()
    for tree in trees:
        for scope, bindings in _scopes(tree):
            found.add(_Scan(scope, bindings, helpers).found)
    return found


def _test_corpus() -> Asserted:
    """What the tests assert appears (tests/docs excluded: the runner's tests and these quote texts
    as data), and the expect-output blocks of the guide, which CI checks against real processes."""
    found = asserted_in([p.read_text(encoding="utf-8") for p in sorted(TESTS.rglob("*.py"))
                         if p.relative_to(TESTS).parts[0] != "docs"])
    for p in sorted(DOCS.rglob("*.md")):
        for b in extract_blocks(p):
            if b.marker and b.marker.has("expect-output"):
                found.strings.append(b.source)
    return found


def fixed_part(text: str) -> str:
    """The longest literal run of a quoted text, without the punctuation at its ends."""
    runs = [r.strip(" .,;:()[]") for r in literal_runs(tokens(text, doc=True))]
    return max(runs, key=len, default="")


def unasserted(texts: list[str], asserted: Asserted) -> list[str]:
    """Texts whose fixed part no positive assertion contains, literally or through the name of the
    template it comes from (e.g. ``assert reason == errors.REASONS["no_socket"].format(...)``)."""
    corpus = "\n".join(asserted.strings)
    missing = []
    for text in texts:
        part = fixed_part(text)
        if len(part) < 8:
            missing.append(f"{text}  (no fixed part of 8 or more characters)")
            continue
        if part in corpus:
            continue
        named = [t for t in matching_templates(text) if t.symbols and all(s in asserted.symbols for s in t.symbols)]
        if not any(part in t.text for t in named):
            missing.append(f"{text}  (no test asserts {part!r} or its template appears)")
    return missing


def test_every_troubleshooting_message_is_produced_by_a_test():
    missing = unasserted(troubleshooting_texts(), _test_corpus())
    assert not missing, "messages in docs/troubleshooting.md that no test asserts:\n" + "\n".join(missing)


def test_the_coverage_check_reports_an_unasserted_message():
    """Negative controls: each way of mentioning a message without asserting it appears is refused."""
    text = "Weights were released"

    def covered(source: str) -> bool:
        return unasserted([text], asserted_in([source])) == []

    assert covered("def test(r):\n    assert r == 'Weights were released'\n")
    assert covered("def test(log):\n    assert 'Weights were released' in log\n")
    assert covered('def test(r):\n    assert r == REASONS["released"]\n')
    assert covered('def test(r):\n    want = errors.REASONS["released"].format()\n    assert (r, 1) == (want, 1)\n')
    assert covered('@pytest.mark.parametrize("m", [REASONS["released"]])\ndef test(m, log):\n    assert m in log\n')
    assert covered("def test():\n    with pytest.raises(E, match='Weights were released'):\n        go()\n")
    assert not covered("from wcache.errors import (\n    REASONS,\n)\n")
    assert not covered("def test(log):\n    # Weights were released\n    assert log\n")
    assert not covered("def test(log):\n    assert 'Weights were released' not in log\n")
    assert not covered('def test(r):\n    assert r != REASONS["released"]\n')
    assert not covered("def test(log):\n    assert not ('Weights were released' in log)\n")
    assert not covered("def test():\n    assert 'Weights were released' == 'Weights were released'\n")
    assert not covered("def test(log):\n    print('Weights were released')\n    assert log\n")
    assert not covered('def test(r):\n    assert r == REASONS["no_socket"]\n')
    assert covered("def check(out, message):\n    assert message in out\n\n"
                   "def test(out):\n    check(out, 'Weights were released')\n")
    assert covered("def test(p):\n    wait_until(lambda: 'Weights were released' in p.log())\n")
    assert not covered("def check(out, message):\n    assert message not in out\n\n"
                       "def test(out):\n    check(out, 'Weights were released')\n")
    assert not covered("def test(p):\n    wait_until(lambda: 'Weights were released' not in p.log())\n")


CORE_PAGES = ["index.md", "quickstart.md", "how-it-works.md", "lifecycle.md", "configuration.md", "security.md",
              "troubleshooting.md", "benchmarks.md", "validation.md"]
LOG_LIKE = re.compile(r"^(Weight cache|Waiting up to|Mapped |WeightCacheKey|Cannot connect|Cannot map|Another weight"
                      r"|Removing stale|Rank \d|Refusing to|Socket directory|Socket path|The daemon kept|Released the"
                      r"|Autotune pass|Unknown ipc_cache|Externally held|Rejecting|Daemon GPU|Unsupported)")


@pytest.mark.parametrize("name", CORE_PAGES)
def test_messages_quoted_in_prose_are_the_codes_texts(name):
    """Messages quoted inline in prose (code spans that start like a message) exist in the code."""
    quoted = [s for s in re.findall(r"`([^`\n]{16,})`", page(name)) if " " in s and LOG_LIKE.match(s)]
    unknown = [q for q in quoted if not matching_templates(q)]
    assert not unknown, f"{name} quotes texts the code does not have:\n" + "\n".join(unknown)


# --------------------------------------------------------------------------------------------
# Metric tables (docs/monitoring.md)
# --------------------------------------------------------------------------------------------


def metric_tables(text: str) -> list[list[tuple[str, str, list[str]]]]:
    """(name, type, labels) rows of each | Metric | Type | Labels | ... table of a page."""
    found = []
    for header, body in tables(text):
        if header[:3] == ["Metric", "Type", "Labels"]:
            found.append([(code_spans(r[0])[0], r[1], code_spans(r[2])) for r in body])
    return found


def declared(metrics) -> list[tuple[str, str, list[str]]]:
    return [(m.exposed, m.kind, list(m.labels)) for m in metrics]


def test_metric_tables_are_every_metric_each_server_declares():
    from wcache.daemon.metrics import METRICS as DAEMON
    from wcache.engine.api_server.metrics import METRICS as ENGINE

    engine, daemon = metric_tables(page("monitoring.md"))
    assert engine == declared(ENGINE) and daemon == declared(DAEMON)
    names = {n for n, _, _ in engine}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_success_total"} <= names  # vLLM's names, as the issue asks
    assert all(n.startswith(("vllm:", "wcache_engine_")) for n in names)
    assert all(n.startswith("wcache_daemon_") for n, _, _ in daemon)
    # Negative control: a row dropped from the page, or a label left out, no longer matches.
    text = page("monitoring.md")
    dropped = re.sub(r"^\| `wcache_daemon_adoptions_total` .*\n", "", text, flags=re.MULTILINE)
    assert metric_tables(dropped)[1] != declared(DAEMON)
    unlabelled = text.replace("| `wcache_engine_weights_fallback` | gauge | `model_name`, `reason` |",
                              "| `wcache_engine_weights_fallback` | gauge | `model_name` |")
    assert unlabelled != text and metric_tables(unlabelled)[0] != declared(ENGINE)
