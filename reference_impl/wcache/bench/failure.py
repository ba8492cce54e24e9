"""How `wcache bench` fails: with the last log lines of the daemon or engine that failed, printed by
the bench itself. Its work directory (and every log in it) is removed when the bench ends, so a path
to a log would point at nothing: every failure of bench code goes through ``bench_failure``."""

from __future__ import annotations

import collections
import logging

from wcache.errors import BenchError

log = logging.getLogger("wcache.bench")

TAIL_LINES = 20


def log_tail(who: str, text: str) -> int:
    """Log the last ``TAIL_LINES`` lines of ``text`` as ``who``'s; the number of lines logged."""
    lines = collections.deque((line for line in text.splitlines() if line.strip()), TAIL_LINES)
    for line in lines:
        log.error("%s: %s", who, line)
    if not lines:
        log.error("%s: (its log is empty)", who)
    return len(lines)


def bench_failure(what: str, who: str, text: str, code: int | None = None,
                  waited_s: float | None = None) -> BenchError:
    """The error for ``what`` that failed (exit status ``code``) or did not come (within
    ``waited_s``), after logging the last lines ``who`` (the daemon, the engine) wrote."""
    n = log_tail(who, text)
    if waited_s is not None:
        return BenchError(BenchError.WAITED.format(what=what, seconds=waited_s, who=who, lines=n))
    return BenchError(BenchError.FAILED.format(what=what, code=code, who=who, lines=n))
