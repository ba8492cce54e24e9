"""``expect-output`` blocks: each non-empty line must appear in what the previous bash block printed
or in the logs its background commands write, in order within each of those outputs. ``...`` in a
line matches any text, and a leading timestamp / log level / logger name in the output is
tolerated (each part ending at whitespace; not an error level), so the guide can show a log line
without its time."""

from __future__ import annotations

import re

# What may precede a log message: timestamps, level names, [file.py:12], (pid=1), logger names.
# Each must end at whitespace, so a prefix never eats part of a word or number: an expected ``0``
# does not match ``10``, nor ``2 passed`` ``12 passed``. Only the levels of a line that reports
# no failure are tolerated: a line the guide shows without ``ERROR`` must not have been an error.
_PREFIX = (
    r"(?:(?:\d[\d\-/:.,T+Z]*"
    r"|\[[^\]]*\]"
    r"|\([^)]*\)"
    r"|(?:DEBUG|INFO|WARNING|WARN):?"
    r"|(?!(?:ERROR|CRITICAL|FATAL):)[A-Za-z_][\w.\-]*:"
    r")\s+)*"
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
