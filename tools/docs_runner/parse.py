"""A page's fenced blocks, from markdown-it tokens: language, body, line, marker, snippets resolved.

CommonMark plus what the site's Markdown uses around code: admonitions (``!!! note``, ``??? tip``),
content tabs (``=== "Title"``) and front matter, so a fence indented by 4 inside any of them is a
fence. An indented (unfenced) code block is an error: the runner would not see it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from markdown_it import MarkdownIt
from mdit_py_plugins.admon import admon_plugin
from mdit_py_plugins.front_matter import front_matter_plugin

from . import DOCS, ROOT
from .markers import Marker, MarkerError, check_applies, is_marker, norm_lang, parse_marker
from .snippets import resolve_snippets
from .tabs import tabs_plugin


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


def markdown() -> MarkdownIt:
    return MarkdownIt("commonmark").use(front_matter_plugin).use(admon_plugin).use(tabs_plugin)


_MD = markdown()


def display(page: Path, root: Path = ROOT) -> str:
    try:
        return page.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(page)


def _closed(lines: list[str], token) -> bool:
    """Whether a fence token ends with its closing fence (CommonMark closes it at the end of its
    container instead, which would run the rest of the page as code)."""
    last = lines[token.map[1] - 1].strip() if token.map[1] - 1 > token.map[0] else ""
    return token.map[1] - token.map[0] >= 2 and re.fullmatch(
        re.escape(token.markup[0]) + "{" + str(len(token.markup)) + ",}", last) is not None


def extract_blocks(page: Path | str, root: Path = ROOT) -> list[Block]:
    """Every fenced block of one markdown page, in order, with its marker."""
    page = Path(page)
    if not page.is_absolute() and not page.exists():
        page = root / page
    page = page.resolve()
    rel = display(page, root)
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str]] = []  # (line, marker comment) waiting for its fence
    for token in _MD.parse(text):
        if token.map is None or token.nesting == -1:
            continue
        line = token.map[0] + 1
        if token.type == "html_block" and is_marker(token.content):
            pending.append((line, token.content))
            continue
        if token.type == "code_block":
            raise MarkerError(
                f"{rel}:{line}: indented code block; use a fenced block (the runner only runs"
                " fences; admonition, tab and list bodies are indented by 4 under their opener)"
            )
        if token.type != "fence":
            if pending:
                raise MarkerError(
                    f"{rel}:{pending[0][0]}: block marker is not followed by a fenced block"
                    f" (found {lines[token.map[0]].strip()[:60]!r} at line {line})"
                )
            continue
        where = f"{rel}:{line}"
        if not _closed(lines, token):
            raise MarkerError(f"{where}: fence {token.markup} is never closed")
        marker = None
        if pending:
            marker = parse_marker("\n".join(t for _, t in pending), f"{rel}:{pending[0][0]}", pending[0][0])
            pending = []
        lang = norm_lang(token.info)
        if marker:
            check_applies(marker, lang, where)
        source, includes = resolve_snippets(token.content, root, where)
        blocks.append(Block(page, rel, len(blocks), line, token.info.strip(), lang, token.content, marker,
                            source, includes))
    if pending:
        raise MarkerError(f"{rel}:{pending[0][0]}: block marker at the end of the page")
    return blocks


def doc_pages(docs: Path = DOCS) -> list[Path]:
    return sorted(p for p in docs.rglob("*.md") if p.is_file())
