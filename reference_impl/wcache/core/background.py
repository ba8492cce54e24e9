"""A function run on a thread of its own, started without waiting for the thread.

``threading.Thread.start()`` returns only once the new thread has run and said so: a hand-over of
the GIL that cost 0.4-0.6 ms, measured, on an engine's way to its weights (the hand-back watcher
of every zero_copy load, the release of every copy-mode load). Nothing started here needs that
handshake, so it is a raw thread (``_thread``, what threading builds on) with an Event for join.
A raw thread does not keep the interpreter alive; ``finish_before_exit`` makes the interpreter wait
for it on the way out (an exit in the middle of a driver call aborts the process), as it waits for
a non-daemon thread. The function catches what it expects; anything else is printed by Python's
hook for threads that fail (sys.unraisablehook).
"""

from __future__ import annotations

import _thread
import atexit
import threading


class Background:
    def __init__(self, fn, *args, finish_before_exit: bool = False):
        self._done = threading.Event()
        self._at_exit = finish_before_exit
        if finish_before_exit:
            atexit.register(self.join)
        _thread.start_new_thread(self._run, (fn, args))

    def _run(self, fn, args) -> None:
        try:
            fn(*args)
        finally:
            self._done.set()
            if self._at_exit:
                atexit.unregister(self.join)

    def join(self, timeout: float | None = None) -> bool:
        """True once the function has returned (or raised)."""
        return self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()
