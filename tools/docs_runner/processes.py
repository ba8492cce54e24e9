"""What a page leaves running: every bash block runs in a session of its own, and everything in
those sessions (background jobs included, ``&`` in a non-interactive shell keeps the session) is
stopped when the page ends: SIGTERM, a grace period, SIGKILL, and a wait until it is gone."""

from __future__ import annotations

import os
import signal
import time

#: Grace period between SIGTERM and SIGKILL at page teardown.
TERM_GRACE_S = 10.0


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, sid) of a process, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[3])


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def members(sessions: set[int]) -> list[int]:
    """Live (non-zombie) processes whose session or process group is one of ``sessions`` (a
    session leader's pid is also its group's id)."""
    found = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        st = proc_stat(int(d))
        if st and st[0] not in ("Z", "X") and (st[1] in sessions or st[2] in sessions):
            found.append(int(d))
    return found


def stop_sessions(sessions: set[int], grace: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM every process of the sessions, wait up to ``grace``, SIGKILL what is left, wait
    again. Returns the pids that survived (should be none)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = members(sessions)
        if not pids:
            return []
        for g in sessions:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in pids:  # a process that moved to a group of its own within the session
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not members(sessions):
                return []
            time.sleep(0.05)
    return members(sessions)
