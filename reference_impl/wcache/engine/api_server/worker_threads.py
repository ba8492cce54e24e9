"""The HTTP front door's threads: kept alive between jobs instead of one new thread each.

``ThreadingHTTPServer`` starts a thread per connection, and a streamed completion started one more
for its ``Engine.generate`` (fanout.py). ``Thread.start`` waits until the new thread runs, and under
load it waits for the GIL behind every other thread, the accept loop with it: 16 clients connecting
at once to a 2-core CPU engine were accepted 1.5-2 ms apart, and the last request reached the
scheduler some 20 ms after the first. Here an idle thread takes the next job from a queue; a new one
starts only when none is idle, and up to ``MAX_IDLE`` idle threads stay for the next burst.
"""

from __future__ import annotations

import queue
import threading

MAX_IDLE = 64  # idle threads kept (each holds only the pages of its stack it touched)
START_IDLE = 32  # started with the server: a burst of 16 streamed requests takes 32 (connection, generate)


class WorkerThreads:
    """Runs each submitted ``fn(*args)`` on a thread of its own, reusing idle ones."""

    def __init__(self, name: str, start_idle: int = START_IDLE):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job, or about to: each job put has a taker
        self._closed = False
        self.prestart(start_idle)

    def prestart(self, n: int) -> None:
        """Start ``n`` idle threads (a server does it on a thread of its own: 32 thread starts take
        some 4 ms, which a promoted --respawn spare would add to its first answer)."""
        for _ in range(n):
            with self._lock:
                if self._closed:
                    return
                self._idle += 1
            self._start(None)

    def submit(self, fn, *args) -> None:
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        if reuse:
            self._jobs.put((fn, args))
        else:
            self._start((fn, args))

    def close(self) -> None:
        """Idle threads leave now, busy ones after their job."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    def _start(self, job) -> None:
        threading.Thread(target=self._run, args=(job,), name=self._name, daemon=True).start()

    def _run(self, job) -> None:
        while True:
            if job is None:
                job = self._jobs.get()
                if job is None:
                    return
            fn, args = job
            fn(*args)  # (a job handles its own errors: the server's thread logs them)
            job = None
            with self._lock:
                if self._closed or self._idle >= MAX_IDLE:
                    return
                self._idle += 1
