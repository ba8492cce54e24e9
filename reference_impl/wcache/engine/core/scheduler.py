"""The scheduler: the waiting queue, the running batch, and which sequences each step decodes.

Iteration-level scheduling, as Orca and vLLM do it: the batch is decided anew before every step.
A request waits in a bounded FIFO queue (``--max-waiting-requests``; past it ``add`` refuses at
once, and the HTTP layer answers 503 with ``Retry-After``). Before each step, waiting requests
join the running batch while a KV cache slot is free (``--max-num-seqs`` slots, memory.py), each
taking the lowest free slot; a sequence leaves when it finishes or its client goes away, and its
slot is free for the next step. Between steps ``compact`` moves the highest running sequences down
into free slots below them, so the running slots stay packed at the bottom: a GPU decodes the slots
up to the last running one (engine/worker/gpu_steps.py), and a sequence's tokens do not depend on its slot. So a short request sent while long ones run starts at the next
step instead of after them.

A burst on an idle engine (many clients sending at once) is admitted together: before the first
step of an idle engine, the scheduler waits while other requests are still being read by the HTTP
layer, at most ``ARRIVAL_WAIT_S``, so that their prompts share that step instead of each waiting for
the step before. A lone request (nothing else arriving) and a busy engine never wait.

Threads: HTTP threads ``add`` and ``cancel``; the engine loop (engine.py) alone calls
``next_step`` and ``finish``. One condition variable guards both queues.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front process imports QueueFull from here, and no torch
    from wcache.engine.worker.sampling import Sampler


# The longest an idle engine's first step waits for requests still arriving. 16 streaming clients
# sending at once reached a 2-core CPU engine over about 16 ms: the first one's prompt ran alone,
# slowed by the others' intake, and the other 15 waited for it (time to first token p99 about 6
# times a lone request's).
ARRIVAL_WAIT_S = 0.02


class QueueFull(Exception):
    """The waiting queue holds ``--max-waiting-requests`` requests."""

    def __init__(self, waiting: int, limit: int):
        super().__init__(waiting, limit)
        self.waiting, self.limit = waiting, limit


@dataclass(eq=False)
class Sequence:
    """One request as the engine loop sees it. The loop appends tokens to ``outbox``, which the
    request's own thread drains (Engine.generate): the loop never waits for a client."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]  # EOS and the generation config's stop ids
    out: list[int] = field(default_factory=list)
    slot: int = -1
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False  # set by the request's thread (a stop string, a client gone)
    arrived: float = field(default_factory=time.monotonic)
    lens: list[int] = field(default_factory=lambda: [0, 0])  # speculative: target, draft KV positions
    spec: list[int] = field(default_factory=lambda: [0, 0])  # speculative: draft tokens proposed, accepted
    # A request resumed on another engine core (core_engine.py): the tokens its client has already,
    # which the loop takes in place of its picks, one decode pass each, so their KV and everything
    # after are what the dead core computed (a prefill of them is faster but not bit-identical).
    replay: deque = field(default_factory=deque)

    @property
    def position(self) -> int:
        """KV positions that hold this sequence's tokens (all but the last one sampled)."""
        return len(self.prompt) + len(self.out) - 1


@dataclass
class Step:
    joining: list[Sequence]  # admitted now: their prompts run first (prefill)
    running: list[Sequence]  # every running sequence, the joining ones included


class Scheduler:
    def __init__(self, num_slots: int, max_waiting: int):
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(num_slots))  # a heap: the lowest free slot first (contiguous slots are views)
        self._cv = threading.Condition()
        self.closed = False
        # wait_arrived(timeout): the HTTP layer's (http_front.Connections), once the server has the engine.
        self.wait_arrived = None

    # -- HTTP threads -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        with self._cv:
            if self.closed:
                raise RuntimeError("the engine is stopping")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(len(self.waiting), self.max_waiting)
            self.waiting.append(seq)
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """The request needs no more tokens: it leaves before the next step."""
        seq.cancelled = True

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the engine loop ------------------------------------------------------------------------
    def next_step(self, timeout: float) -> Step | None:
        """The next step's batch, once there is work (or an empty Step after ``timeout`` idle);
        None once closed. Cancelled waiting requests are dropped here, never run."""
        with self._cv:
            deadline = time.monotonic() + timeout
            while not self.closed and not self.running and not self.waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Step([], [])
                self._cv.wait(left)
            if self.closed:
                return None
            burst = bool(self.waiting) and not self.running and self.wait_arrived is not None
        if burst:  # outside the lock: the arriving requests' threads add themselves meanwhile
            self.wait_arrived(ARRIVAL_WAIT_S)
        with self._cv:
            if self.closed:
                return None
            joining = []
            while self.waiting and self._free:
                seq = self.waiting.popleft()
                if seq.cancelled:  # its thread no longer reads the outbox
                    continue
                seq.slot = heapq.heappop(self._free)
                joining.append(seq)
                self.running.append(seq)
            return Step(joining, list(self.running))

    def compact(self) -> list[tuple[Sequence, int, int]]:
        """Move every running sequence that has a free slot below it into the lowest one, highest
        first: (sequence, old slot, new slot) for each (its slot already the new one). The caller
        copies their keys before the next pass."""
        moves = []
        with self._cv:
            for seq in sorted((s for s in self.running if s.slot >= 0), key=lambda s: s.slot, reverse=True):
                if not self._free or self._free[0] > seq.slot:
                    break
                new = heapq.heapreplace(self._free, seq.slot)  # the lowest free slot out, the old one in
                moves.append((seq, seq.slot, new))
                seq.slot = new
        return moves

    def finish(self, seq: Sequence) -> None:
        with self._cv:
            if seq in self.running:  # not when close() took it
                self.running.remove(seq)
                heapq.heappush(self._free, seq.slot)

    def close(self) -> list[Sequence]:
        """Stop scheduling; every sequence still waiting or running, for the loop to end."""
        with self._cv:
            self.closed = True
            left = list(self.waiting) + self.running
            self.waiting.clear()
            self.running = []
            self._cv.notify_all()
            return left
