"""``StopFlag``: a stop request that a signal handler may set, a ``threading.Event`` without a lock.

Python runs a signal handler on the main thread between two bytecodes, wherever that thread is:
inside ``Event.wait`` while it holds the Event's lock, or inside the same handler run for an earlier
signal (``kill`` of a process group and a launcher's own SIGTERM reach a rank together).
``Event.set`` takes that lock, so a handler that calls it can wait forever for its own thread. A
daemon rank hung so on two SIGTERMs until its launcher killed it (py-spy: ``on_stop`` -> ``Event.set``
inside ``on_stop`` -> ``Event.set``, the main thread waiting for the lock it held).

``set`` takes no lock: it sets a plain attribute (one bytecode: atomic under the GIL) and writes a
byte to a pipe that ``wait`` polls. The byte is never read, so the pipe stays readable and every
waiter, now or later, wakes. Once set, the flag stays set; a stop is never taken back.
"""

from __future__ import annotations

import math
import os
import select


class StopFlag:
    def __init__(self):
        self._set = False
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                os.write(self._w, b"x")
            except OSError:  # already written (a racing set) or closed: the attribute is what counts
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds pass; True when set (as ``Event.wait``)."""
        if not self._set:
            poller = select.poll()  # not select(): a daemon raises its descriptor limit past 1024
            poller.register(self._r, select.POLLIN)
            poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
        return self._set

    def close(self) -> None:
        """Free the pipe; the flag then only answers ``is_set``."""
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1
