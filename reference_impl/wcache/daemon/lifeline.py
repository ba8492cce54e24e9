"""A daemon rank never outlives the `wcache preload` that started it.

A launcher killed with SIGKILL runs no cleanup, so it cannot stop its ranks; an orphaned rank would
keep the device's lock, its socket and a copy of the weights, and the next `wcache preload` would
stop at "Another weight cache daemon already owns ...". So each rank asks the kernel to send it
SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), then checks that its parent is still the
launcher that started it: one that died before the prctl call would otherwise go unnoticed (the
rank has been re-parented already, and the kernel signals only on a later death). SIGTERM, not
SIGKILL: a serving rank removes its socket and frees its arena on the way out.

The kernel sends the signal when the *thread* that forked the rank ends, not the process: the
launcher starts its ranks from its main thread, which lives as long as the launcher does.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have ``sig`` sent to this process when its parent, ``parent_pid``, dies (now, if it has)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the launcher died before the prctl call: act as if signalled now
        os.kill(os.getpid(), sig)
