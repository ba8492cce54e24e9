"""Content tabs (pymdownx.tabbed: ``=== "Title"`` with a body indented by 4) for markdown-it.

mdit-py-plugins has admonitions (``admon``) but no tabs (executablebooks/mdit-py-plugins#102). Without
this rule CommonMark reads a tab's body, indented by 4, as an indented code block, and the fences
inside it would not be found. Like Python-Markdown, the tab lasts while its lines are indented by at
least 4 more than the ``===`` line; blank lines inside it do not end it.
"""

from __future__ import annotations

import re

from markdown_it import MarkdownIt
from markdown_it.rules_block import StateBlock
from mdit_py_plugins.utils import is_code_block

TAB = re.compile(r'^===[+!]*[ \t]+"(?P<title>[^"]*)"')


def _tab(state: StateBlock, start_line: int, end_line: int, silent: bool) -> bool:
    if is_code_block(state, start_line):
        return False
    start = state.bMarks[start_line] + state.tShift[start_line]
    m = TAB.match(state.src[start : state.eMarks[start_line]])
    if not m:
        return False
    if silent:
        return True
    indent = state.sCount[start_line] + 4
    last = start_line
    line = start_line + 1
    while line < end_line:
        if not state.isEmpty(line):
            if state.sCount[line] < indent:
                break
            last = line
        line += 1
    end = last + 1
    saved = state.parentType, state.lineMax, state.blkIndent
    state.parentType, state.lineMax, state.blkIndent = "tab", end, indent  # type: ignore[assignment]
    token = state.push("tab_open", "div", 1)
    token.block, token.info, token.map = True, m.group("title"), [start_line, end]
    state.md.block.tokenize(state, start_line + 1, end)
    token = state.push("tab_close", "div", -1)
    token.block = True
    state.parentType, state.lineMax, state.blkIndent = saved
    state.line = end
    return True


def tabs_plugin(md: MarkdownIt) -> None:
    md.block.ruler.before("fence", "tabs", _tab, {"alt": ["paragraph", "reference", "blockquote", "list"]})
