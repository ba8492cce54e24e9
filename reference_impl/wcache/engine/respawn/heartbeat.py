"""The serving ``--respawn`` worker's heartbeat: proof to its supervisor (engine/respawn/respawn.py) that
its decode loop is not stuck.

A thread writes a beat (an empty line, which the supervisor's JSON-line reader skips) on the
worker's status pipe every ``interval_s``. It watches the engine's forward passes, not the HTTP
path: a server can be slow to answer for good reasons (a long queue, a client that reads slowly),
but one forward pass that has not returned for ``stall_s`` is stuck (a kernel that never ends, a
deadlock). Then the thread stops beating, and the supervisor, after its bound, kills the worker
with SIGKILL and promotes its spare. A SIGSTOPped worker stops every thread, the beat included.
"""

from __future__ import annotations

import functools
import threading
import time


class Heartbeat(threading.Thread):
    def __init__(self, beat, interval_s: float, stall_s: float):
        super().__init__(name="wcache-heartbeat", daemon=True)
        self.beat, self.interval_s, self.stall_s = beat, interval_s, stall_s
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}  # forward passes in flight: thread id -> start

    def watch(self, runner) -> None:
        """Time every forward pass of ``runner`` (an attribute of this one instance only)."""
        forward = runner.forward

        @functools.wraps(forward)
        def timed(*args, **kwargs):
            me = threading.get_ident()
            with self._lock:
                self._since[me] = time.monotonic()
            try:
                return forward(*args, **kwargs)
            finally:
                with self._lock:
                    self._since.pop(me, None)

        runner.forward = timed

    def stuck_for(self) -> float:
        """How long the oldest forward pass in flight has run (0 when none)."""
        with self._lock:
            oldest = min(self._since.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            if self.stuck_for() <= self.stall_s:
                self.beat()
