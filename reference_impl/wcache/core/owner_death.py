"""``OwnerDeath``: learn that a process died as it dies, not once the kernel has torn it down.

A SIGKILLed process closes its file descriptors only after its address space is gone (the kernel's
``do_exit``: ``exit_mm`` before ``exit_files``), so a peer reading its socket sees the end late: a
process that has only imported torch takes 20 to 60 ms to close its end after the signal, one that
holds 1 GiB of written memory 130 to 300 ms (tests/unit/test_owner_death.py measures both on the
host that runs it). That wait was most of a `--respawn` front's kill-to-next-answer.

What the kernel does first, before that teardown, is release the dying thread's robust futexes
(``exit_mm_release`` -> ``exit_robust_list``): a robust, process-shared pthread mutex the dead
process held is marked owner-died and one waiter is woken at once. So the owner (an engine core)
locks such a mutex for its whole life on a thread of its own, and the watcher (the front) waits to
lock it; the wait ends with ``EOWNERDEAD`` within a millisecond or so of the death, however much
memory the dead process still has to give back.

The mutex lives in a memfd of one page, made by the watcher and inherited by the owner (``fd``);
glibc's pthread functions through ctypes (which drops the GIL while they block). Linux with glibc
only; ``available()`` says whether this process has them, and callers keep the socket's end as the
fallback and the proof (a death is still confirmed by reaping). No torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading

PTHREAD_PROCESS_SHARED = 1
PTHREAD_MUTEX_ROBUST = 1
MUTEX_BYTES = 64  # >= sizeof(pthread_mutex_t) (40 on x86-64 and aarch64 glibc)
ATTR_BYTES = 16  # >= sizeof(pthread_mutexattr_t) (4 on x86-64, 8 on aarch64)


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.pthread_mutexattr_setrobust  # glibc >= 2.12
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def available() -> bool:
    return _LIBC is not None and hasattr(os, "memfd_create")


class OwnerDeath:
    """One robust process-shared mutex in a memfd page: ``hold`` in the owner, ``wait`` in the watcher."""

    def __init__(self, fd: int | None = None):
        """``fd`` None: make the page and the mutex (the watcher, before it starts the owner);
        else map the page the watcher made (the owner, given the inherited descriptor)."""
        if fd is None:
            fd = os.memfd_create("wcache-owner-death", os.MFD_CLOEXEC)
            os.ftruncate(fd, mmap.PAGESIZE)
            self._map = mmap.mmap(fd, mmap.PAGESIZE)
            self._init_mutex()
        else:
            self._map = mmap.mmap(fd, mmap.PAGESIZE)
        self.fd = fd
        self._mutex = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(self._map)))

    def _init_mutex(self) -> None:
        attr = ctypes.create_string_buffer(ATTR_BYTES)
        for call, *args in (("pthread_mutexattr_init",), ("pthread_mutexattr_setpshared", PTHREAD_PROCESS_SHARED),
                            ("pthread_mutexattr_setrobust", PTHREAD_MUTEX_ROBUST)):
            _check(getattr(_LIBC, call)(attr, *args), call)
        mutex = ctypes.c_char.from_buffer(self._map)
        _check(_LIBC.pthread_mutex_init(ctypes.byref(mutex), attr), "pthread_mutex_init")
        del mutex  # no export of the map may outlive this call (mmap.close would refuse)

    def close_fd(self) -> None:
        """The watcher's descriptor, once the owner has inherited it (the mapping stays)."""
        os.close(self.fd)

    # -- the owner -------------------------------------------------------------------------------
    def hold(self) -> None:
        """Lock the mutex on a thread of this process that never unlocks it: it is released only
        by this process's death. Returns once held."""
        held = threading.Event()

        def keep() -> None:
            code = _LIBC.pthread_mutex_lock(self._mutex)
            if code == errno.EOWNERDEAD:  # an earlier owner died holding it: ours now, made consistent
                _LIBC.pthread_mutex_consistent(self._mutex)
            held.set()
            threading.Event().wait()  # forever: the lock is this thread's, and the thread lives as long as the process

        threading.Thread(target=keep, name="wcache-owner-death", daemon=True).start()
        held.wait()

    # -- the watcher ------------------------------------------------------------------------------
    def wait(self) -> bool:
        """Block until the owner dies (True), having taken the mutex from it; False if the mutex
        was free (no owner held it: it never started, or it is this process's own)."""
        code = _LIBC.pthread_mutex_lock(self._mutex)
        if code == errno.EOWNERDEAD:
            _LIBC.pthread_mutex_consistent(self._mutex)
            _LIBC.pthread_mutex_unlock(self._mutex)  # free again for a next owner
            return True
        if code == 0:
            _LIBC.pthread_mutex_unlock(self._mutex)
            return False
        raise OSError(code, f"pthread_mutex_lock: {os.strerror(code)}")

    def watch(self, on_death) -> None:
        """``wait`` on a daemon thread, then ``on_death()`` if the owner died."""
        def run() -> None:
            if self.wait():
                on_death()
        threading.Thread(target=run, name="wcache-owner-death-watch", daemon=True).start()


def _check(code: int, call: str) -> None:
    if code != 0:
        raise OSError(code, f"{call}: {os.strerror(code)}")
