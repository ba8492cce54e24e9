"""``expect-output`` blocks: each non-empty line must appear in what the previous bash block printed
or in the logs its background commands write, in order within each of those outputs. ``...`` in a
line matches any text, and a leading timestamp / log level / logger name in the output is
tolerated (each part ending at whitespace; an error level only after an expect-fail block), so
the guide can show a log line without its time."""

from __future__ import annotations

import re

# What may precede a log message: timestamps, level names, [file.py:12], (pid=1), logger names.
# Each must end at whitespace, so a prefix never eats part of a word or number: an expected ``0``
# does not match ``10``, nor ``2 passed`` ``12 passed``. Error levels are tolerated only after a
# block marked expect-fail: elsewhere a line the guide shows without ``ERROR`` must not be an error.
_LEVELS = "DEBUG|INFO|WARNING|WARN"
_ERROR_LEVELS = "ERROR|CRITICAL|FATAL"


def _prefix(error_levels: bool) -> str:
    levels = _LEVELS + ("|" + _ERROR_LEVELS if error_levels else "")
    not_a_level = "" if error_levels else rf"(?!(?:{_ERROR_LEVELS}):)"
    return (r"(?:(?:\d[\d\-/:.,T+Z]*"
            r"|\[[^\]]*\]"
            r"|\([^)]*\)"
            rf"|(?:{levels}):?"
            rf"|{not_a_level}[A-Za-z_][\w.\-]*:"
            r")\s+)*")


def expected_line_regex(line: str, error_levels: bool = False) -> re.Pattern[str]:
    parts = [re.escape(p) for p in line.strip().split("...")]
    # An expected line is shown stripped, so an indented output line (a bench's sub-line) matches too.
    return re.compile(r"^\s*" + _prefix(error_levels) + ".*?".join(parts) + r"\s*$")


def match_output(expected: str, sources: list[tuple[str, str]], error_levels: bool = False) -> str | None:
    """Check expected lines against named outputs; order is enforced within each source.
    ``error_levels``: the output is of a block expected to fail (its error lines may be shown
    without their level). Returns None when every line matched, else a failure description."""
    split = [(name, text.splitlines()) for name, text in sources]
    cursor = [0] * len(split)
    for exp in expected.splitlines():
        if not exp.strip():
            continue
        rx = expected_line_regex(exp, error_levels)
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
