"""The thread that runs a rank's forward passes: a ``--respawn`` spare's warm-up while it waits,
then, once promoted, the engine loop (engine.py). One thread for both, because the libraries keep
per-thread state that a new thread builds again on its first pass: OpenMP's thread team on CPU
(the first pass on a new thread took 6 ms more than on a warm one, a 2-core host, tiny preset), and
on a GPU cuBLAS's handle and workspace. Warmed on another thread, that cost would land in the first
answer after a promotion instead of in the spare's wait.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class LoopThread:
    """Runs the callables it is given, in order, on one daemon thread; ``run_last`` hands it its
    last one (the engine loop), after which the thread ends."""

    def __init__(self, name: str = "wcache-engine"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the thread; its result here, or its exception raised here."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._tasks.put((fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def run_last(self, fn: Callable[[], None]) -> None:
        """Start ``fn()`` on the thread without waiting; the thread ends when it returns."""
        self._tasks.put((fn, None))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            fn, done = self._tasks.get()
            if done is None:
                fn()
                return
            try:
                done.put((True, fn()))
            except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
                done.put((False, e))
