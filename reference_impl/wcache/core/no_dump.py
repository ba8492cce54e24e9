"""No other process of the same user may read or write a wcache process's memory or take its descriptors.

Linux lets a process of the same uid open ``/proc/PID/mem`` (read and write the heap, the weights,
an API key), call ``ptrace`` and take any descriptor with ``pidfd_getfd`` (a listening socket, an
arena's memfd). All of these need "ptrace access", which the kernel refuses to a caller without
CAP_SYS_PTRACE once the target has cleared its dumpable flag (``prctl(PR_SET_DUMPABLE, 0)``, as
OpenSSH's agent and gpg-agent do); the same flag also keeps the process from writing a core dump of
the weights. ``execve`` sets the flag back to 1, so every wcache entry point (the command line, a
daemon rank, an engine worker, a spare, the respawn supervisor) calls ``forbid()`` first thing.

What it leaves: a process of the same uid may still signal the process (kill it) and connect to its
sockets, where the daemon's own checks apply (docs/security.md); root, or a process with
CAP_SYS_PTRACE, is not stopped by it. ``/proc/PID/{status,stat,cmdline}`` stay readable.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_DUMPABLE = 4  # <linux/prctl.h>
PR_GET_DUMPABLE = 3


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, arg, 0, 0, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return result


def forbid() -> None:
    """Clear this process's dumpable flag: no same-uid ptrace, /proc/PID/mem, pidfd_getfd or core dump."""
    _prctl(PR_SET_DUMPABLE, 0)


def dumpable() -> bool:
    return _prctl(PR_GET_DUMPABLE) != 0
