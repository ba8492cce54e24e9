"""Extract, classify and run every fenced block of the wcache guide.

Every fenced block (```` ``` ```` or ``~~~``, at any indentation, so also inside admonitions and
content tabs) of ``docs/**/*.md`` is either run, validated, or carries a marker that says why not.
This module is the single place that defines how; ``docs/contributing.md`` explains it to writers.

Dispatch by language
--------------------
``python``
    Run with pytest-examples (``EvalExample.run_print_check``): ``#>`` comments below a ``print``
    must match what it prints. Python blocks of one page share their globals, in order, and run
    in the page's working directory with the page's environment (``TMPDIR`` included).
``bash`` / ``sh`` / ``shell``
    Run for real by ``bash`` with ``set -euo pipefail`` (and ``set -a``: assigned variables are
    exported). Blocks of one page run in order in one per-page working directory, with ``TMPDIR``
    set to a per-page directory (so wcache's default socket dir is private to the page),
    ``WCACHE_CACHE_ROOT`` to a per-page directory, and ``.venv/bin`` first on ``PATH``. Exported
    variables and the working directory carry over to the page's next block. Before running, the
    substitutions of ``tools/substitutions.yaml`` are applied. A command line that starts with
    ``wcache preload`` or ``wcache serve`` (after ``VAR=value`` prefixes, ``exec`` or ``nohup``;
    backslash continuations and multi-line quotes are joined) is started in the background in its
    own session and awaited: ``preload`` until its log shows ``Weight cache daemon READY``,
    ``serve`` until ``GET /health`` on 127.0.0.1 and its ``--port`` (default 8000) answers 200.
    When such a line ends with ``&`` it is awaited at the end of the block instead, so the block's
    next lines run while it starts, as in a shell. Any other command line that ends with ``&`` is
    started the same way and tracked, but not awaited. Every
    process started like this is stopped (SIGTERM to its process group, then SIGKILL) when the page
    ends, and the runner waits until it is gone.
``yaml`` / ``yml``
    Parsed (all documents). A Compose file (top-level ``services``) is validated against the
    compose-spec JSON schema vendored in check-jsonschema; a Kubernetes object (``apiVersion`` and
    ``kind``) with kubernetes-validate in strict mode for Kubernetes ``K8S_VERSION``; a bare pod
    spec (``containers`` without ``kind``) is wrapped in a Pod first. Other YAML is parsed only.
``json``
    Parsed. With the ``loader-config`` marker it is also validated by
    ``wcache.engine.loader.parse_loader_config`` (parsed only while that function does not exist).
``console`` / ``text`` / ``log`` with ``expect-output``
    Every non-empty line must appear in the output of the page's previous bash block (its
    stdout/stderr and the logs of the background processes it started), in order within each of
    those outputs. ``...`` in a line matches any text; a leading timestamp / log-level / logger
    prefix in the output is tolerated.

Indented (unfenced) code blocks are rejected: the runner would not see them. Admonition, content
tab and list bodies (indented by 4 under their opener) are recognised as such.

GPU mode (``WCACHE_RUN_GPU_BLOCKS=1``, used by ``make test-gpu`` on a CUDA host): no substitutions,
and blocks skipped with a reason starting with ``GPU-only`` are run.

Snippets: a line ``--8<-- "examples/compose.yaml"`` inside a block is replaced by that file
(relative to the repository root, as pymdownx.snippets does with ``base_path: ["."]``), so the
file the reader sees is the file that is validated or run.

Markers
-------
An HTML comment on the line(s) just before a fence (blank lines allowed in between)::

    <!-- block: skip reason="GPU-only: needs a CUDA device" -->

holds space-separated words and ``key="value"`` attributes; see ``MARKERS`` and ``ATTRIBUTES``.
A marker comment that is not followed by a fence is an error, and so is an unknown word or a
skip/illustration without a non-empty reason.

Command line
------------
``python tools/blocks.py list [PAGE...]``
    Every block with page:line, language and disposition, then the coverage counts.
``python tools/blocks.py run PAGE [PAGE...]``
    Run the given pages' blocks (through pytest, like CI does).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SUBSTITUTIONS_FILE = ROOT / "tools" / "substitutions.yaml"

#: Kubernetes version whose strict schemas (shipped with kubernetes-validate) the guide targets.
K8S_VERSION = "1.30.0"
#: What ``wcache preload`` logs once every rank serves.
READY_LINE = "Weight cache daemon READY"
#: Default seconds to wait for an awaited ``wcache preload`` / ``wcache serve``.
READY_TIMEOUT_S = 120.0
#: Default wall-clock limit of one bash block.
BLOCK_TIMEOUT_S = 300.0
#: Grace period between SIGTERM and SIGKILL at page teardown.
TERM_GRACE_S = 10.0
#: Set to 1 on a GPU machine: substitutions are off and "GPU-only" skips are run.
GPU_ENV = "WCACHE_RUN_GPU_BLOCKS"
#: Set to 1 to keep each page's working directory after the page ends.
KEEP_ENV = "WCACHE_DOCS_KEEP"

# --------------------------------------------------------------------------------------------
# Marker vocabulary: the one place it is defined.
# --------------------------------------------------------------------------------------------

RUN_LANGS = {"python", "bash"}
VALIDATE_LANGS = {"yaml", "json"}
OUTPUT_LANGS = {"console", "text", "log"}
LANG_ALIASES = {
    "py": "python",
    "python3": "python",
    "sh": "bash",
    "shell": "bash",
    "yml": "yaml",
}


@dataclasses.dataclass(frozen=True)
class MarkerSpec:
    doc: str
    langs: frozenset[str] | None = None  # None: any language
    needs_reason: bool = False
    alone: bool = False  # cannot be combined with other words


MARKERS: dict[str, MarkerSpec] = {
    "skip": MarkerSpec(
        "Not run or validated here; the reason says why and where it is (e.g. 'GPU-only: ...',"
        " 'multi-node: ...'). Reasons starting with 'GPU-only' run when WCACHE_RUN_GPU_BLOCKS=1.",
        needs_reason=True,
        alone=True,
    ),
    "illustration": MarkerSpec(
        "Shows a shape (a placeholder, an excerpt, markup about markup), never meant to run.",
        needs_reason=True,
        alone=True,
    ),
    "expect-output": MarkerSpec(
        "Each non-empty line must appear, in order, in the output of the previous bash block on"
        " the page ('...' matches any text).",
        langs=frozenset(OUTPUT_LANGS),
    ),
    "expect-fail": MarkerSpec(
        "The block must fail: a bash block must exit non-zero, a YAML/JSON block must be rejected"
        " by its validator. Its output still feeds a following expect-output block.",
        langs=frozenset({"bash", "yaml", "json"}),
    ),
    "loader-config": MarkerSpec(
        "A --model-loader-extra-config JSON object: validated by"
        " wcache.engine.loader.parse_loader_config (unknown keys and bad values are rejected).",
        langs=frozenset({"json"}),
    ),
}

ATTRIBUTES: dict[str, str] = {
    "reason": "Why a block is skipped or only an illustration (required by skip/illustration).",
    "timeout": "bash only: seconds to await each wcache preload/serve (default 120); the block's"
    " own limit becomes max(300, 3 x timeout).",
}


class MarkerError(ValueError):
    """A marker, fence or snippet that the runner refuses (with page:line in the message)."""


class BlockFailure(AssertionError):
    """A block that ran or was validated and did not do what the guide says."""


@dataclasses.dataclass
class Marker:
    words: tuple[str, ...]
    attrs: dict[str, str]
    line: int  # 1-based line of the comment

    def has(self, word: str) -> bool:
        return word in self.words

    @property
    def reason(self) -> str:
        return self.attrs.get("reason", "")

    def __str__(self) -> str:
        parts = list(self.words) + [f'{k}="{v}"' for k, v in self.attrs.items()]
        return "<!-- block: " + " ".join(parts) + " -->"


_MARKER_RE = re.compile(r"^\s*<!--\s*block:(?P<body>.*?)-->\s*$", re.DOTALL)


def parse_marker(text: str, where: str, line: int) -> Marker:
    """Parse one ``<!-- block: ... -->`` comment (possibly spanning lines)."""
    m = _MARKER_RE.match(text)
    if not m:
        raise MarkerError(f"{where}: malformed block marker {text.strip()!r}")
    try:
        tokens = shlex.split(m.group("body"))
    except ValueError as e:
        raise MarkerError(f"{where}: cannot parse block marker {text.strip()!r}: {e}") from None
    words: list[str] = []
    attrs: dict[str, str] = {}
    for tok in tokens:
        if "=" in tok:
            key, _, value = tok.partition("=")
            if key not in ATTRIBUTES:
                raise MarkerError(
                    f"{where}: unknown marker attribute {key!r}; known: {', '.join(ATTRIBUTES)}"
                )
            attrs[key] = value.strip()
        else:
            if tok not in MARKERS:
                raise MarkerError(f"{where}: unknown marker word {tok!r}; known: {', '.join(MARKERS)}")
            words.append(tok)
    if not words and not attrs:
        raise MarkerError(f"{where}: block marker names no marker ({', '.join(MARKERS)})")
    marker = Marker(tuple(words), attrs, line)
    for w in words:
        spec = MARKERS[w]
        if spec.needs_reason and not marker.reason:
            raise MarkerError(f'{where}: "{w}" marker needs a non-empty reason="..."')
        if spec.alone and len(words) > 1:
            raise MarkerError(f'{where}: "{w}" cannot be combined with {words}')
    if "reason" in attrs and not any(MARKERS[w].needs_reason for w in words):
        raise MarkerError(f"{where}: reason= is only for skip/illustration markers")
    if "timeout" in attrs:
        try:
            if float(attrs["timeout"]) <= 0:
                raise ValueError
        except ValueError:
            raise MarkerError(f"{where}: timeout must be a positive number of seconds") from None
    return marker


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    page: Path  # absolute path of the markdown file
    rel: str  # the page as shown: relative to the repository root when possible
    index: int  # 0-based position on the page
    line: int  # 1-based line of the opening fence
    info: str  # the raw info string
    lang: str  # normalised language ('' if none)
    body: str  # the body as written in the page, de-indented
    marker: Marker | None
    source: str  # the body with snippet includes resolved: what is run or validated
    includes: tuple[str, ...]  # snippet paths included by the body

    @property
    def where(self) -> str:
        return f"{self.rel}:{self.line}"


_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_CONTAINER_OPEN = re.compile(r"^[ ]*(?:(?:!!!|\?\?\?\+?|===\+?)[ ]|(?:[-*+]|\d+[.)])(?:[ ]|$))")
_SNIPPET = re.compile(r"^\s*-{1,}8<-{1,}\s+(?P<q>['\"])(?P<spec>.+?)(?P=q)\s*$")


def _norm_lang(info: str) -> str:
    info = info.strip()
    if info.startswith("{"):
        info = info.strip("{}").strip()
    first = info.split()[0] if info.split() else ""
    first = first.lstrip(".").lower()
    return LANG_ALIASES.get(first, first)


def _display(page: Path, root: Path) -> str:
    try:
        return page.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(page)


def resolve_snippets(body: str, root: Path, where: str) -> tuple[str, tuple[str, ...]]:
    """Replace ``--8<-- "path"`` (and ``"path:START:END"``) lines by the file's content."""
    out: list[str] = []
    included: list[str] = []
    for line in body.splitlines(keepends=True):
        m = _SNIPPET.match(line)
        if not m:
            out.append(line)
            continue
        spec = m.group("spec")
        path, start, end = spec, None, None
        parts = spec.rsplit(":", 2)
        if len(parts) == 3 and all(p.isdigit() or p == "" for p in parts[1:]):
            path = parts[0]
            start = int(parts[1]) if parts[1] else None
            end = int(parts[2]) if parts[2] else None
        file = (root / path).resolve()
        if not file.is_file():
            raise MarkerError(f"{where}: snippet {spec!r} not found (looked for {file})")
        lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
        if start is not None or end is not None:
            lines = lines[(start or 1) - 1 : end]
        text = "".join(lines)
        if text and not text.endswith("\n"):
            text += "\n"
        out.append(text)
        included.append(path)
    return "".join(out), tuple(included)


def extract_blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of one markdown page, in order, with its marker."""
    page = Path(page)
    if not page.is_absolute() and not page.exists():
        page = root / page
    page = page.resolve()
    rel = _display(page, root)
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str]] = []  # (line, marker comment text) waiting for a fence
    i = 0
    containers = [0]  # content indents of the open admonitions / tabs / list items
    prev_blank = True
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            prev_blank = True
            i += 1
            continue
        # All code must be fenced, or the runner would not see it. markdownlint's MD046 cannot
        # tell MkDocs admonition/tab bodies from indented code, so the check lives here.
        ind = len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip(" "))
        while len(containers) > 1 and ind < containers[-1]:
            containers.pop()
        if prev_blank and ind >= containers[-1] + 4:
            raise MarkerError(
                f"{rel}:{i + 1}: indented code block; use a fenced block (the runner only runs"
                " fences; admonition, tab and list bodies are indented by 4 under their opener)"
            )
        if _CONTAINER_OPEN.match(line):
            containers.append(ind + 4)
        prev_blank = False
        m = _FENCE_OPEN.match(line)
        if m and not (m.group("fence")[0] == "`" and "`" in m.group("info")):
            indent = len(m.group("indent").expandtabs(4))
            fence = m.group("fence")
            close = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            if j >= len(lines):
                raise MarkerError(f"{rel}:{i + 1}: fence {fence} is never closed")
            body_lines = []
            for raw in lines[i + 1 : j]:
                raw = raw.expandtabs(4)
                k = 0
                while k < indent and k < len(raw) and raw[k] == " ":
                    k += 1
                body_lines.append(raw[k:])
            body = "\n".join(body_lines) + ("\n" if body_lines else "")
            where = f"{rel}:{i + 1}"
            marker = None
            if pending:
                # Several marker comments before one fence combine into one marker.
                inner = ""
                for ln, t in pending:
                    mm = _MARKER_RE.match(t)
                    if not mm:
                        raise MarkerError(f"{rel}:{ln}: malformed block marker {t.strip()!r}")
                    inner += " " + mm.group("body")
                first = pending[0][0]
                marker = parse_marker(f"<!-- block:{inner} -->", f"{rel}:{first}", first)
                pending = []
            lang = _norm_lang(m.group("info"))
            if marker:
                for w in marker.words:
                    spec = MARKERS[w]
                    if spec.langs is not None and lang not in spec.langs:
                        raise MarkerError(
                            f"{where}: marker {w!r} does not apply to a {lang or 'untagged'} block"
                            f" (only {', '.join(sorted(spec.langs))})"
                        )
                if "timeout" in marker.attrs and lang != "bash":
                    raise MarkerError(f"{where}: timeout= only applies to bash blocks")
            source, includes = resolve_snippets(body, root, where)
            blocks.append(
                Block(
                    page=page,
                    rel=rel,
                    index=len(blocks),
                    line=i + 1,
                    info=m.group("info").strip(),
                    lang=lang,
                    body=body,
                    marker=marker,
                    source=source,
                    includes=includes,
                )
            )
            i = j + 1
            continue
        if stripped.startswith("<!--") and re.match(r"<!--\s*block:", stripped):
            start = i
            text = line
            while "-->" not in text and i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
            if "-->" not in text:
                raise MarkerError(f"{rel}:{start + 1}: block marker comment is never closed")
            pending.append((start + 1, text))
        elif pending:
            raise MarkerError(
                f"{rel}:{pending[0][0]}: block marker is not followed by a fenced block"
                f" (found {stripped[:60]!r} at line {i + 1})"
            )
        i += 1
    if pending:
        raise MarkerError(f"{rel}:{pending[0][0]}: block marker at the end of the page")
    return blocks


def has_gpu_only_blocks(page: Path, root: Path = ROOT) -> bool:
    """Whether a page has blocks skipped with a reason starting with "GPU-only"."""
    try:
        found = extract_blocks(page, root)
    except MarkerError:
        return False
    return any(
        b.marker and b.marker.has("skip") and b.marker.reason.lower().startswith("gpu-only") for b in found
    )


def doc_pages(docs: Path = DOCS) -> list[Path]:
    return sorted(p for p in docs.rglob("*.md") if p.is_file())


# --------------------------------------------------------------------------------------------
# Classification and coverage
# --------------------------------------------------------------------------------------------

RUN, VALIDATED, SKIPPED, UNMARKED = "run", "validated", "skipped", "unmarked"


def gpu_mode() -> bool:
    return os.environ.get(GPU_ENV, "") not in ("", "0")


def disposition(block: Block, gpu: bool | None = None) -> tuple[str, str]:
    """(run | validated | skipped | unmarked, detail) for one block, without running it."""
    gpu = gpu_mode() if gpu is None else gpu
    mk = block.marker
    if mk and mk.has("skip") and not (gpu and mk.reason.lower().startswith("gpu-only")):
        return SKIPPED, mk.reason
    if mk and mk.has("illustration"):
        return SKIPPED, "illustration: " + mk.reason
    if block.lang in RUN_LANGS:
        return RUN, block.lang
    if block.lang in VALIDATE_LANGS:
        return VALIDATED, block.lang
    if mk and mk.has("expect-output"):
        return VALIDATED, "expect-output"
    return UNMARKED, f"{block.lang or 'untagged'} block without a marker"


@dataclasses.dataclass
class Result:
    where: str
    lang: str
    kind: str  # run / validated / skipped / unmarked / failed
    detail: str


class Recorder:
    """Collects what actually happened to each block during a test session."""

    def __init__(self) -> None:
        self.results: list[Result] = []
        self.substitutions_applied: collections.Counter[int] = collections.Counter()
        self.used = False  # set by the docs tests, so the session summary knows to print

    def add(self, block: Block, kind: str, detail: str = "") -> None:
        self.results.append(Result(block.where, block.lang, kind, detail))


#: The session-wide recorder used by tests/docs (fixture pages of the runner's own tests do not
#: record here).
SESSION = Recorder()


def coverage(blocks: Iterable[Block], gpu: bool | None = None) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    unmarked: list[str] = []
    for b in blocks:
        kind, detail = disposition(b, gpu)
        counts[kind] += 1
        if kind == SKIPPED:
            reasons[detail] += 1
        elif kind == UNMARKED:
            unmarked.append(f"{b.where} ({detail})")
    return {"counts": counts, "skipped_reasons": reasons, "unmarked": unmarked}


def format_summary(
    blocks: list[Block],
    recorder: Recorder | None = None,
    substitutions: list[Substitution] | None = None,
    errors: list[str] | None = None,
) -> str:
    cov = coverage(blocks)
    c = cov["counts"]
    pages = len({b.rel for b in blocks})
    out = [
        f"docs blocks: {len(blocks)} on {pages} page(s): run {c[RUN]}, validated {c[VALIDATED]},"
        f" skipped {c[SKIPPED]}, unmarked {c[UNMARKED]}" + ("  [GPU mode]" if gpu_mode() else "")
    ]
    for reason, n in sorted(cov["skipped_reasons"].items()):
        out.append(f"  skipped x{n}: {reason}")
    for u in cov["unmarked"]:
        out.append(f"  UNMARKED: {u}")
    for e in errors or []:
        out.append(f"  ERROR: {e}")
    if recorder is not None and recorder.results:
        done = collections.Counter(r.kind for r in recorder.results)
        out.append(
            "  executed this session: "
            + ", ".join(f"{k} {done[k]}" for k in (RUN, VALIDATED, SKIPPED, "failed") if done[k])
        )
    if substitutions:
        out.append(
            "  substitutions (tools/substitutions.yaml)" + (" - off in GPU mode" if gpu_mode() else "") + ":"
        )
        for n, s in enumerate(substitutions):
            applied = recorder.substitutions_applied[n] if recorder else 0
            out.append(f"    {s.pattern_text!r} -> {s.replace!r} (applied {applied}x): {s.reason}")
    return "\n".join(out)


def all_blocks(docs: Path = DOCS, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """All blocks of the guide, and the extraction errors (one per broken page)."""
    blocks: list[Block] = []
    errors: list[str] = []
    for page in doc_pages(docs):
        try:
            blocks.extend(extract_blocks(page, root))
        except MarkerError as e:
            errors.append(str(e))
    return blocks, errors


# --------------------------------------------------------------------------------------------
# Substitutions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Substitution:
    pattern: re.Pattern[str]
    pattern_text: str
    replace: str
    reason: str


def load_substitutions(path: Path = SUBSTITUTIONS_FILE) -> list[Substitution]:
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    subs = []
    for n, entry in enumerate(data.get("substitutions", [])):
        if not isinstance(entry, dict) or not entry.get("reason"):
            raise ValueError(f"{path}: substitution #{n + 1} needs a reason")
        if ("literal" in entry) == ("regex" in entry):
            raise ValueError(f"{path}: substitution #{n + 1} needs exactly one of literal/regex")
        if "literal" in entry:
            text = str(entry["literal"])
            pattern = re.compile(re.escape(text))
            repl = str(entry.get("replace", "")).replace("\\", "\\\\")
        else:
            text = str(entry["regex"])
            pattern = re.compile(text)
            repl = str(entry.get("replace", ""))
        subs.append(Substitution(pattern, text, repl, " ".join(str(entry["reason"]).split())))
    return subs


def apply_substitutions(script: str, subs: list[Substitution], recorder: Recorder | None = None) -> str:
    for n, s in enumerate(subs):
        script, count = s.pattern.subn(s.replace, script)
        if recorder is not None and count:
            recorder.substitutions_applied[n] += count
    return script


# --------------------------------------------------------------------------------------------
# Bash: finding long-running commands and rewriting them
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LogicalLine:
    text: str  # as written, continuations and multi-line quotes included, no trailing newline
    code_end: int  # index in text where a trailing comment starts (len(text) if none)
    heredoc: bool = False  # a here-document body (never rewritten)


def logical_lines(script: str) -> list[LogicalLine]:
    """Split a bash script into logical lines: backslash-newline continuations and newlines
    inside quotes are joined; here-document bodies are kept as single opaque entries."""
    out: list[LogicalLine] = []
    i, n = 0, len(script)
    while i < n:
        start = i
        quote = ""
        comment_at = -1
        while i < n:
            ch = script[i]
            if comment_at >= 0:
                if ch == "\n":
                    break
                i += 1
                continue
            if quote == "'":
                if ch == "'":
                    quote = ""
                i += 1
                continue
            if ch == "\\" and i + 1 < n:
                i += 2
                continue
            if quote == '"':
                if ch == '"':
                    quote = ""
                i += 1
                continue
            if ch in "'\"":
                quote = ch
            elif ch == "#" and (i == start or script[i - 1] in " \t;&|("):
                comment_at = i
            elif ch == "\n":
                break
            i += 1
        text = script[start:i]
        code_end = (comment_at - start) if comment_at >= 0 else len(text)
        out.append(LogicalLine(text, code_end))
        i += 1  # the newline
        hd = re.search(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1", text[:code_end])
        if hd and "<<<" not in text[:code_end]:
            strip_tabs = text[hd.start() : hd.start() + 3] == "<<-"
            term = hd.group(2)
            body_start = i
            while i < n:
                end = script.find("\n", i)
                end = n if end < 0 else end
                line = script[i:end]
                i = end + 1
                if (line.lstrip("\t") if strip_tabs else line) == term:
                    break
            body = script[body_start : min(i, n)].rstrip("\n")
            out.append(LogicalLine(body, len(body), heredoc=True))
    return out


_ENV_PREFIX = r"(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"(?:[^\"\\]|\\.)*\"|[^\s'\"])*\s+)*"
_WCACHE_LONG = re.compile(
    r"^\s*" + _ENV_PREFIX + r"(?:exec\s+|nohup\s+)?wcache\s+(?P<kind>preload|serve)(?=\s|$)"
)
_HELP = re.compile(r"(?:^|\s)(?:--help|-h|--version)(?=\s|$)")
_TRAILING_AMP = re.compile(r"(?<![&>|])&\s*$")
_PORT = re.compile(r"(?:^|\s)--port(?:=|\s+(?:\\\n\s*)?)(?P<port>\"[^\"]*\"|'[^']*'|[^\s;&|]+)")
_STDOUT_REDIRECT = re.compile(r"(?:^|\s)(?:1?>>?|&>>?)\s*(?P<target>\"[^\"]+\"|'[^']+'|[^\s;&|<>]+)")


_RESERVED = {"if", "then", "while", "until", "for", "case", "select", "function", "time", "!", "{", "[[", "(("}


def exec_form(cmd: str) -> str:
    """``cmd`` with ``exec`` in front of its command word when it is one simple command, so the
    ``bash -c`` that runs it becomes the command itself and ``$!`` is the command's pid, as in an
    interactive shell (``wcache serve ... > engine.log 2>&1 &`` then ``kill $!`` stops the engine).
    Anything with pipes, lists, subshells or command substitutions is returned unchanged."""
    quote = ""
    i = 0
    while i < len(cmd):
        ch = cmd[i]
        if ch == "\\" and quote != "'":
            i += 2  # an escaped character (or a line continuation) is never an operator
            continue
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif (ch in "|;()`\n" or (ch == "$" and cmd[i + 1 : i + 2] == "(")
              or (ch == "&" and not (cmd[i - 1 : i] in (">", "<") or cmd[i + 1 : i + 2] == ">"))):
            return cmd  # a pipe, list, subshell, substitution or background: not one simple command
        i += 1
    if quote:
        return cmd
    prefix = re.match(r"\s*" + _ENV_PREFIX, cmd)
    rest = cmd[prefix.end() :]
    words = rest.split()
    if not words or words[0] in _RESERVED or words[0] == "exec":
        return cmd
    return cmd[: prefix.end()] + "exec " + rest


@dataclasses.dataclass
class Background:
    kind: str  # preload / serve / bg
    log: str


def rewrite_script(
    script: str, log_dir: Path, tag: str, ready_timeout: float
) -> tuple[str, list[Background]]:
    """Rewrite long-running command lines so they start in their own session, are tracked for
    teardown and (wcache preload/serve) awaited. Returns the new script and what it starts."""
    out: list[str] = []
    started: list[Background] = []
    deferred: list[str] = []  # awaits of `wcache ... &` lines: at the end of the block
    for ll in logical_lines(script):
        code = ll.text[: ll.code_end].rstrip()
        if ll.heredoc or not code.strip():
            out.append(ll.text)
            continue
        m = _WCACHE_LONG.match(code)
        long_kind = m.group("kind") if m and not _HELP.search(code) else None
        explicit_bg = bool(_TRAILING_AMP.search(code))
        if not long_kind and not explicit_bg:
            out.append(ll.text)
            continue
        cmd = _TRAILING_AMP.sub("", code).rstrip() if explicit_bg else code
        kind = long_kind or "bg"
        log = log_dir / f"{tag}-{len(started) + 1}-{kind}.log"
        started.append(Background(kind, str(log)))
        qlog = shlex.quote(str(log))
        out.append(f"# wcache-docs: {kind} started in the background and tracked")
        out.append(f"setsid bash -o pipefail -c {shlex.quote(exec_form(cmd.strip()))} >{qlog} 2>&1 </dev/null &")
        user_logs = [r.group("target") for r in _STDOUT_REDIRECT.finditer(cmd)]
        user_log = user_logs[-1] if user_logs else "''"
        out.append(f'__wcb_track "$!" {kind} {qlog} {user_log}')
        if long_kind:
            port = "8000"
            pm = _PORT.search(cmd)
            if pm:
                port = pm.group("port")
            args = f'--kind {kind} --pid "$!" --timeout {ready_timeout:g} --log {qlog}'
            if user_logs:
                args += f" --log {user_log}"
            if kind == "serve":
                args += f" --port {port}"
            if explicit_bg:
                # `&` returns at once in a shell, so the block's next lines run while it starts
                # (e.g. an engine that waits for a daemon started on a later line).
                var = f"__wcb_bg{len(started)}"
                out.append(f'{var}="$!"')
                deferred.append(f"__wcb_await {args}".replace('--pid "$!"', f'--pid "${var}"'))
            else:
                out.append(f"__wcb_await {args}")
    if deferred:
        out.append("# wcache-docs: await what the block started with `&`")
        out += deferred
    return "\n".join(out) + "\n", started


PRELUDE = r"""# --- tools/blocks.py prelude ---
set -euo pipefail
__wcb_track() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" "$PWD" >> "$WCB_STATE/bg"; }
__wcb_await() { "$WCB_PYTHON" "$WCB_TOOL" await "$@"; }
__wcb_exit() {
  __wcb_rc=$?
  env -0 > "$WCB_STATE/env" 2>/dev/null || true
  pwd > "$WCB_STATE/cwd" 2>/dev/null || true
  exit "$__wcb_rc"
}
trap __wcb_exit EXIT
set -a
# --- block ---
"""

_ENV_NOT_CARRIED = {"PWD", "OLDPWD", "SHLVL", "_", "__wcb_rc"}


# --------------------------------------------------------------------------------------------
# Awaiting readiness (runs as `blocks.py await` inside the block's bash)
# --------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, sid) of a process, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[3])


def _alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _tail(path: str | Path, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:]) if lines else f"(empty log {path})"


def _health_ok(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def await_ready(kind: str, pid: int, logs: list[str], port: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    what = f"wcache {kind} (pid {pid})"
    while True:
        if kind == "preload":
            for log in logs:
                try:
                    if READY_LINE in Path(log).read_text(encoding="utf-8", errors="replace"):
                        return 0
                except OSError:
                    pass
        elif _health_ok(port):
            return 0
        if not _alive(pid):
            print(f"[blocks.py] {what} exited before it was ready. Log tail:", file=sys.stderr)
            for log in logs:
                print(f"--- {log}\n{_tail(log)}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            want = f"{READY_LINE!r} in its log" if kind == "preload" else f"200 from :{port}/health"
            print(
                f"[blocks.py] {what} not ready after {timeout:g}s (waiting for {want}). Log tail:",
                file=sys.stderr,
            )
            for log in logs:
                print(f"--- {log}\n{_tail(log)}", file=sys.stderr)
            return 1
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Process teardown
# --------------------------------------------------------------------------------------------


def _members(groups: set[int], sessions: set[int]) -> list[int]:
    """Live (non-zombie) processes in any of the process groups or sessions."""
    found = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        st = _proc_stat(int(d))
        if st and st[0] not in ("Z", "X") and (st[1] in groups or st[2] in sessions):
            found.append(int(d))
    return found


def stop_processes(groups: set[int], sessions: set[int], grace: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM every process of the groups/sessions, wait, SIGKILL what is left, wait again.
    Returns the pids that survived (should be empty)."""
    if not groups and not sessions:
        return []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = _members(groups, sessions)
        if not pids:
            return []
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _members(groups, sessions):
                return []
            time.sleep(0.05)
    return _members(groups, sessions)


# --------------------------------------------------------------------------------------------
# Output matching
# --------------------------------------------------------------------------------------------

# What may precede a log message: timestamps, level names, [file.py:12], (pid=1), logger names.
_PREFIX = (
    r"(?:(?:\d[\d\-/:.,T+Z]*"
    r"|\[[^\]]*\]"
    r"|\([^)]*\)"
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b:?"
    r"|[A-Za-z_][\w.\-]*:(?=\s))\s*)*"
)


def expected_line_regex(line: str) -> re.Pattern[str]:
    parts = [re.escape(p) for p in line.strip().split("...")]
    return re.compile("^" + _PREFIX + ".*?".join(parts) + r"\s*$")


def match_output(expected: str, sources: list[tuple[str, str]]) -> str | None:
    """Check expected lines against named outputs; order is enforced within each source.
    Returns None when every line matched, else a failure description."""
    split = [(name, text.splitlines()) for name, text in sources]
    cursor = [0] * len(split)
    for exp in expected.splitlines():
        if not exp.strip():
            continue
        rx = expected_line_regex(exp)
        for s, (_, lines) in enumerate(split):
            hit = next((k for k in range(cursor[s], len(lines)) if rx.match(lines[k])), None)
            if hit is not None:
                cursor[s] = hit + 1
                break
        else:
            shown = "\n".join(
                f"--- {name} (searched from line {cursor[s] + 1})\n"
                + "\n".join(lines[max(cursor[s], len(lines) - 40) :])
                for s, (name, lines) in enumerate(split)
            )
            return f"expected line not found (in order): {exp.strip()!r}\n{shown}"
    return None


# --------------------------------------------------------------------------------------------
# YAML / JSON validation
# --------------------------------------------------------------------------------------------

_COMPOSE_SCHEMA: dict | None = None


def _compose_schema() -> dict:
    global _COMPOSE_SCHEMA
    if _COMPOSE_SCHEMA is None:
        from importlib import resources

        ref = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
        _COMPOSE_SCHEMA = json.loads(ref.read_text(encoding="utf-8"))
    return _COMPOSE_SCHEMA


def validate_compose(doc: dict) -> list[str]:
    import jsonschema

    schema = _compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    errors = sorted(cls(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"compose: /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def validate_k8s(doc: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(map(str, e.absolute_path))
        return [f"kubernetes {K8S_VERSION} (strict) {doc.get('kind')}: /{path}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"kubernetes: {e.message}"]
    return []


def validate_yaml(text: str) -> tuple[list[str], str]:
    """(errors, what was checked)."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        return [f"YAML does not parse: {e}"], "yaml"
    errors: list[str] = []
    kinds: list[str] = []
    for d in docs:
        if isinstance(d, dict) and "services" in d:
            kinds.append("compose")
            errors += validate_compose(d)
        elif isinstance(d, dict) and "apiVersion" in d and "kind" in d:
            kinds.append(f"k8s {d['kind']}")
            errors += validate_k8s(d)
        elif isinstance(d, dict) and "containers" in d and "kind" not in d:
            kinds.append("k8s pod spec")
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "docs-example"}, "spec": d}
            errors += validate_k8s(pod)
        else:
            kinds.append("yaml (parsed)")
    return errors, ", ".join(kinds) or "yaml (empty)"


def validate_json(text: str, loader_config: bool) -> tuple[list[str], str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"JSON does not parse: {e}"], "json"
    if not loader_config:
        return [], "json (parsed)"
    try:
        from wcache.engine.loader import LoaderConfigError, parse_loader_config
    except ImportError:
        return [], "json (parsed; wcache.engine.loader.parse_loader_config not available yet)"
    try:
        parse_loader_config(obj)
    except LoaderConfigError as e:
        return [f"LoaderConfigError: {e}"], "loader-config"
    return [], "loader-config"


# --------------------------------------------------------------------------------------------
# Running a page
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BashRun:
    block: Block
    output_file: Path
    background: list[tuple[str, str]]  # (kind, log path) incl. the writer's own redirect targets


class PageRunner:
    """Runs the blocks of one page, in order, sharing one working directory and environment."""

    def __init__(
        self,
        page: Path,
        *,
        request: Any = None,
        root: Path = ROOT,
        recorder: Recorder | None = None,
        extra_path: Iterable[Path] = (),
        substitutions: list[Substitution] | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        grace: float = TERM_GRACE_S,
        gpu: bool | None = None,
    ) -> None:
        self.page = Path(page)
        self.request = request
        self.root = Path(root)
        self.recorder = recorder
        self.extra_path = [Path(p) for p in extra_path]
        self.gpu = gpu_mode() if gpu is None else gpu
        if substitutions is None:
            substitutions = [] if self.gpu else load_substitutions()
        self.substitutions = substitutions
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.groups: set[int] = set()
        self.sessions: set[int] = set()
        self.last_bash: BashRun | None = None
        self.py_globals: dict[str, Any] = {}
        self.outputs: list[BashRun] = []

    # -- setup / teardown ---------------------------------------------------------------------

    def _setup(self) -> None:
        # Short paths: Unix socket paths are limited to 107 bytes and TMPDIR holds the socket dir.
        self.dir = Path(tempfile.mkdtemp(prefix="wcb-", dir="/tmp" if Path("/tmp").is_dir() else None))
        self.cwd = self.dir / "work"
        self.tmp = self.dir / "tmp"
        self.logs = self.dir / "logs"
        self.state = self.dir / "state"
        for d in (self.cwd, self.tmp, self.logs, self.state, self.dir / "py"):
            d.mkdir()
        path = [str(p) for p in self.extra_path] + [
            str(ROOT / ".venv" / "bin"),
            str(Path(sys.executable).parent),
            os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ]
        self.env = dict(os.environ)
        self.env.update(
            TMPDIR=str(self.tmp),
            # wcache's on-disk cache (fingerprint memo): cold and private for every page.
            WCACHE_CACHE_ROOT=str(self.dir / "cache"),
            PATH=os.pathsep.join(path),
            PYTHONUNBUFFERED="1",
            WCB_STATE=str(self.state),
            WCB_PYTHON=sys.executable,
            WCB_TOOL=str(Path(__file__).resolve()),
        )

    def teardown(self) -> list[str]:
        survivors = stop_processes(self.groups, self.sessions, self.grace)
        problems = []
        if survivors:
            problems.append(f"processes still alive after SIGKILL at teardown: {survivors}")
        return problems

    # -- the page ----------------------------------------------------------------------------

    def run(self) -> None:
        blocks = extract_blocks(self.page, self.root)
        self._setup()
        failure: str | None = None
        try:
            for block in blocks:
                self.run_block(block)
        except BlockFailure as e:
            failure = str(e)
        finally:
            problems = self.teardown()
        if failure is None and problems:
            failure = f"{_display(self.page, self.root)}: " + "; ".join(problems)
        if os.environ.get(KEEP_ENV, "") in ("", "0"):
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)
        elif failure is not None:
            failure += f"\n(page working directory kept: {self.dir})"
        if failure is not None:
            raise BlockFailure(failure)

    def _record(self, block: Block, kind: str, detail: str = "") -> None:
        if self.recorder is not None:
            self.recorder.add(block, kind, detail)

    def _fail(self, block: Block, msg: str) -> None:
        self._record(block, "failed", msg.splitlines()[0] if msg else "")
        raise BlockFailure(f"{block.where} ({block.lang} block): {msg}")

    def run_block(self, block: Block) -> None:
        kind, detail = disposition(block, self.gpu)
        if kind == UNMARKED:
            self._record(block, UNMARKED, detail)
            return  # the coverage test fails on it; the page itself still runs
        if kind == SKIPPED:
            self._record(block, SKIPPED, detail)
            return
        expect_fail = bool(block.marker and block.marker.has("expect-fail"))
        if block.lang == "bash":
            self.run_bash(block, expect_fail)
            self._record(block, RUN, "bash")
        elif block.lang == "python":
            self.run_python(block)
            self._record(block, RUN, "python")
        elif block.lang == "yaml":
            errors, what = validate_yaml(block.source)
            self._check_validation(block, errors, what, expect_fail)
        elif block.lang == "json":
            loader = bool(block.marker and block.marker.has("loader-config"))
            errors, what = validate_json(block.source, loader)
            self._check_validation(block, errors, what, expect_fail)
        elif block.marker and block.marker.has("expect-output"):
            self.check_output(block)
            self._record(block, VALIDATED, "expect-output")
        else:  # pragma: no cover - disposition() covers every case
            self._fail(block, f"no way to handle ({kind}: {detail})")

    def _check_validation(self, block: Block, errors: list[str], what: str, expect_fail: bool) -> None:
        src = f" (from {', '.join(block.includes)})" if block.includes else ""
        if expect_fail and not errors:
            self._fail(block, f"marked expect-fail but {what}{src} accepted it")
        if errors and not expect_fail:
            self._fail(block, f"{what}{src} rejected it:\n  " + "\n  ".join(errors))
        self._record(block, VALIDATED, what + src)

    # -- bash --------------------------------------------------------------------------------

    def run_bash(self, block: Block, expect_fail: bool) -> None:
        script = apply_substitutions(block.source, self.substitutions, self.recorder)
        ready_timeout = self.ready_timeout
        block_timeout = BLOCK_TIMEOUT_S
        if block.marker and "timeout" in block.marker.attrs:
            ready_timeout = float(block.marker.attrs["timeout"])
            block_timeout = max(BLOCK_TIMEOUT_S, 3 * ready_timeout)
        tag = f"b{block.index + 1:02d}-L{block.line}"
        body, _ = rewrite_script(script, self.logs, tag, ready_timeout)
        script_file = self.state / f"{tag}.sh"
        script_file.write_text(PRELUDE + body, encoding="utf-8")
        out_file = self.logs / f"{tag}.out"
        bg_file = self.state / "bg"
        bg_before = bg_file.read_text().count("\n") if bg_file.exists() else 0
        timed_out = False
        with open(out_file, "wb") as out:
            proc = subprocess.Popen(
                ["bash", str(script_file)],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.sessions.add(proc.pid)
            try:
                rc = proc.wait(timeout=block_timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                stop_processes({proc.pid}, {proc.pid}, 2.0)
                rc = proc.wait()
        background: list[tuple[str, str]] = []
        if bg_file.exists():
            for line in bg_file.read_text().splitlines()[bg_before:]:
                pid, kind, log, user_log, cwd = (line.split("\t") + [""] * 5)[:5]
                self.groups.add(int(pid))
                self.sessions.add(int(pid))
                background.append((kind, log))
                if user_log:
                    background.append((kind, str(Path(cwd) / user_log)))
        self._load_state()
        run = BashRun(block, out_file, background)
        self.last_bash = run
        self.outputs.append(run)
        if timed_out:
            self._fail(block, f"timed out after {block_timeout:g}s\n{self._output_tail(run)}")
        if expect_fail and rc == 0:
            self._fail(block, f"marked expect-fail but exited 0\n{self._output_tail(run)}")
        if not expect_fail and rc != 0:
            self._fail(block, f"exited {rc}\n{self._output_tail(run)}")

    def _load_state(self) -> None:
        env_file = self.state / "env"
        if env_file.exists():
            env = {}
            for item in env_file.read_bytes().split(b"\0"):
                k, sep, v = item.decode(errors="surrogateescape").partition("=")
                if sep and k not in _ENV_NOT_CARRIED and not k.startswith("__wcb"):
                    env[k] = v
            if env:
                self.env = env
            env_file.unlink()
        cwd_file = self.state / "cwd"
        if cwd_file.exists():
            cwd = Path(cwd_file.read_text().strip())
            if cwd.is_dir():
                self.cwd = cwd
            cwd_file.unlink()

    def _sources(self, run: BashRun) -> list[tuple[str, str]]:
        sources = [(f"output of the bash block at {run.block.where}", run.output_file)]
        sources += [(f"log of background {k} ({Path(p).name})", p) for k, p in run.background]
        out = []
        for name, path in sources:
            try:
                out.append((name, Path(path).read_text(encoding="utf-8", errors="replace")))
            except OSError:
                out.append((name, ""))
        return out

    def _output_tail(self, run: BashRun, n: int = 40) -> str:
        parts = []
        for name, text in self._sources(run):
            lines = text.splitlines()
            parts.append(f"--- {name} (last {min(n, len(lines))} lines)\n" + "\n".join(lines[-n:]))
        return "\n".join(parts)

    def check_output(self, block: Block) -> None:
        if self.last_bash is None:
            self._fail(block, "expect-output block, but no bash block ran before it on this page")
        problem = match_output(block.source, self._sources(self.last_bash))
        if problem:
            self._fail(block, problem)

    # -- python ------------------------------------------------------------------------------

    def run_python(self, block: Block) -> None:
        if self.request is None:
            raise RuntimeError("python blocks need a pytest request (run them through pytest)")
        import tempfile as _tempfile

        import pytest
        from pytest_examples import CodeExample
        from pytest_examples.eval_example import EvalExample

        example = CodeExample.create(block.source, path=block.page, start_line=block.line, prefix="python")
        eval_example = EvalExample(tmp_path=self.dir / "py", pytest_request=self.request)
        saved_env = dict(os.environ)
        saved_cwd = os.getcwd()
        saved_main = sys.modules.get("__main__")
        saved_tempdir = _tempfile.tempdir
        error: str | None = None
        try:
            os.environ.clear()
            os.environ.update({k: v for k, v in self.env.items() if not k.startswith("WCB_")})
            os.chdir(self.cwd)
            _tempfile.tempdir = None
            module = eval_example.run_print_check(example, module_globals=dict(self.py_globals))
            self.py_globals.update({k: v for k, v in module.items() if not k.startswith("__")})
        except (Exception, SystemExit, pytest.fail.Exception) as e:  # noqa: BLE001 - reported below
            error = _describe_exception(e)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            _tempfile.tempdir = saved_tempdir
            if saved_main is not None:
                sys.modules["__main__"] = saved_main
        if error is not None:
            self._fail(block, error)


def _describe_exception(exc: BaseException) -> str:
    """Exception type, message and the last frames, without the traceback module: pytest-examples
    re-points tracebacks at the markdown lines with synthetic frames that make
    traceback.format_exception raise RuntimeError on Python 3.11."""
    try:
        from _pytest.outcomes import Failed

        if isinstance(exc, Failed):
            return str(exc.msg if hasattr(exc, "msg") else exc)
    except ImportError:  # pragma: no cover
        pass
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        try:
            frames.append(f"  {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        except Exception:  # noqa: BLE001 - a synthetic frame; keep what we can
            frames.append("  <frame>")
        tb = tb.tb_next
    return "Traceback (last frames):\n" + "\n".join(frames[-6:]) + f"\n{type(exc).__name__}: {exc}"


def run_page(page: Path | str, request: Any = None, **kwargs: Any) -> None:
    """Run one page inside a pytest test; a failing block fails the test with a plain message.

    pytest.fail is called outside any ``except`` block on purpose: with pytest-examples on
    Python 3.11 and pytest >= 8.4, failing inside exception handling ends in INTERNALERROR."""
    import pytest

    failure: str | None = None
    try:
        PageRunner(Path(page), request=request, **kwargs).run()
    except (BlockFailure, MarkerError) as e:
        failure = str(e)
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _cmd_list(pages: list[str]) -> int:
    paths = [Path(p) for p in pages] if pages else doc_pages()
    blocks: list[Block] = []
    errors: list[str] = []
    for p in paths:
        try:
            page_blocks = extract_blocks(p)
        except MarkerError as e:
            errors.append(str(e))
            continue
        blocks += page_blocks
        for b in page_blocks:
            kind, detail = disposition(b)
            if kind == SKIPPED:
                shown = f"skipped ({detail})"
            elif kind == UNMARKED:
                shown = f"UNMARKED ({detail})"
            else:
                extras = []
                if b.marker:
                    extras += list(b.marker.words)
                if b.includes:
                    extras.append("snippet " + ", ".join(b.includes))
                shown = kind + (f" ({'; '.join(extras)})" if extras else "")
            print(f"{b.where:<32} {b.lang or '-':<8} {shown}")
    print()
    print(format_summary(blocks, None, load_substitutions(), errors))
    return 1 if errors or coverage(blocks)["unmarked"] else 0


def _cmd_run(pages: list[str]) -> int:
    import pytest

    if not pages:
        print("usage: blocks.py run PAGE [PAGE...]", file=sys.stderr)
        return 2
    os.environ["WCACHE_DOCS_PAGES"] = os.pathsep.join(str(Path(p).resolve()) for p in pages)
    return int(
        pytest.main(
            [
                str(ROOT / "tests" / "docs" / "test_blocks.py"),
                "-k",
                "test_page",
                "-q",
                "-p",
                "no:cacheprovider",
            ]
        )
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="blocks.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="every block with page:line, language, disposition")
    p_list.add_argument("pages", nargs="*")
    p_run = sub.add_parser("run", help="run the blocks of the given pages (through pytest)")
    p_run.add_argument("pages", nargs="*")
    p_await = sub.add_parser("await", help="(internal) wait for a wcache preload/serve")
    p_await.add_argument("--kind", choices=["preload", "serve"], required=True)
    p_await.add_argument("--pid", type=int, required=True)
    p_await.add_argument("--log", action="append", default=[])
    p_await.add_argument("--port", type=int, default=8000)
    p_await.add_argument("--timeout", type=float, default=READY_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.cmd == "list":
        return _cmd_list(args.pages)
    if args.cmd == "run":
        return _cmd_run(args.pages)
    return await_ready(args.kind, args.pid, args.log, args.port, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
