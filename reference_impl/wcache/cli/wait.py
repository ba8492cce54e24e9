"""`wcache wait`: block until a daemon or engine started in the background is ready.

The guide starts `wcache preload` and `wcache serve` with `&`, as an operator does in one terminal,
and then waits with this command; CI runs exactly those lines. Readiness is what wcache itself
reports: the launcher's ``Weight cache daemon READY`` log line (flags.READY, --text's default; or any
other text, for other milestones), and ``GET /health`` answering 200 (the engine's port, or the launcher's
``--weight-cache-health-port``). Every condition given must hold. With ``--pid`` the wait ends at
once, with exit status 2, when that process exits first; a timeout is exit status 2 as well.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from wcache.errors import WaitError

POLL_S = 0.2


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log_has(path: str, text: str) -> bool:
    try:
        return text in Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, exited but not yet reaped by its shell, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def pending(args) -> list[str]:
    """The conditions that do not hold yet, as they read in an error message."""
    out = [f"GET {url} answering 200" for url in args.health if not _health_ok(url)]
    out += [f"{args.text!r} in {log}" for log in args.log if not _log_has(log, args.text)]
    return out


def run_wait(args) -> int:
    if not args.health and not args.log:
        raise WaitError(WaitError.NOTHING)
    if args.timeout <= 0:
        raise WaitError(WaitError.BAD_TIMEOUT.format(timeout=args.timeout))
    deadline = time.monotonic() + args.timeout
    while True:
        waiting = pending(args)
        if not waiting:
            return 0
        # Checked after the conditions: a process that got ready and then exited is not a failure
        # of the wait (a daemon stopped at once, say), and the last look at its log counts.
        if args.pid is not None and not _alive(args.pid):
            raise WaitError(WaitError.EXITED.format(pid=args.pid, what="; ".join(waiting)))
        if time.monotonic() >= deadline:
            raise WaitError(WaitError.TIMEOUT.format(timeout=args.timeout, what="; ".join(waiting)))
        time.sleep(POLL_S)
