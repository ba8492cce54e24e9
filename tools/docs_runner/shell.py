"""Reading a bash block as a reader's shell would, without changing it: logical lines, the commands
that would hold the terminal, and the log files that background commands write.

The runner runs a block's text as shown; this module only looks at it, to refuse a block that would
hang a pasting reader's terminal and to find the logs an ``expect-output`` block may read.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass
class LogicalLine:
    text: str  # as written, continuations and multi-line quotes included, no trailing newline
    code_end: int  # index in text where a trailing comment starts (len(text) if none)
    heredoc: bool = False  # a here-document body

    @property
    def code(self) -> str:
        return self.text[: self.code_end].rstrip()


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
#: A command that runs until it is stopped: a daemon launcher or an engine.
LONG_RUNNING = re.compile(r"^\s*" + _ENV_PREFIX + r"(?:exec\s+|nohup\s+)?wcache\s+(?P<kind>preload|serve)(?=\s|$)")
_EXITS_AT_ONCE = re.compile(r"(?:^|\s)(?:--help|-h|--version)(?=\s|$)")
_TRAILING_AMP = re.compile(r"(?<![&>|])&\s*$")
_STDOUT_REDIRECT = re.compile(r"(?:^|\s)(?:1?>>?|&>>?)\s*(?P<target>\"[^\"]+\"|'[^']+'|[^\s;&|<>]+)")


def in_background(line: LogicalLine) -> bool:
    return bool(_TRAILING_AMP.search(line.code))


def foreground_servers(script: str) -> list[str]:
    """``wcache preload`` / ``wcache serve`` lines that run in the foreground: pasted into a
    terminal they never return (unless they fail, which an expect-fail block may show)."""
    found = []
    for ll in logical_lines(script):
        code = ll.code
        if ll.heredoc or not LONG_RUNNING.match(code) or _EXITS_AT_ONCE.search(code) or in_background(ll):
            continue
        found.append(" ".join(code.split()))
    return found


def background_logs(script: str) -> list[str]:
    """The files that the block's background commands (``... > FILE 2>&1 &``) write their output to."""
    logs = []
    for ll in logical_lines(script):
        if ll.heredoc or not in_background(ll):
            continue
        targets = [m.group("target").strip("'\"") for m in _STDOUT_REDIRECT.finditer(ll.code)]
        if targets:
            logs.append(targets[-1])
    return logs
