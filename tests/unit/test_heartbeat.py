"""The serving worker's heartbeat (engine/respawn/heartbeat.py) with a forward pass stuck while the process
runs: its other threads go on (the HTTP threads, the beat's own), only the pass does not return.
A SIGSTOP (tests/integration/test_respawn.py) freezes every thread, the beat's included, so it
cannot tell whether the beat watches the passes at all; this does. Real threads, real clock; what
is counted is beats, so a loaded machine only makes the windows longer, never the answer wrong.

The break it catches: ``Heartbeat.run`` beating without asking ``stuck_for`` (``if True:``), so a
worker stuck in one pass beats on and is never replaced.
"""

from __future__ import annotations

import threading
import time

from wcache.engine.respawn.heartbeat import Heartbeat

INTERVAL_S, STALL_S = 0.01, 0.2


class Runner:
    """Stands where the engine's RankRunner stands: ``forward`` is what Heartbeat.watch wraps. A
    pass returns at once, unless ``stuck`` is set: then it waits for ``release``."""

    def __init__(self):
        self.stuck, self.release, self.inside = threading.Event(), threading.Event(), threading.Event()

    def forward(self, x):
        self.inside.set()
        if self.stuck.is_set():
            self.release.wait(30)
        return x


class Beats:
    def __init__(self):
        self.n = 0

    def __call__(self):
        self.n += 1

    def grow_within(self, seconds: float, by: int = 3) -> bool:
        start, deadline = self.n, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.n >= start + by:
                return True
            time.sleep(0.005)
        return False


def started(runner: Runner) -> tuple[Heartbeat, Beats]:
    beats = Beats()
    hb = Heartbeat(beats, INTERVAL_S, STALL_S)
    hb.watch(runner)
    hb.start()
    return hb, beats


def test_a_pass_stuck_while_the_process_runs_stops_the_beat_and_it_resumes_when_the_pass_returns():
    runner = Runner()
    hb, beats = started(runner)
    assert beats.grow_within(10)  # no pass in flight: it beats
    runner.stuck.set()
    caller = threading.Thread(target=runner.forward, args=(1,), daemon=True)
    caller.start()
    assert runner.inside.wait(10)
    # Once the pass has run past STALL_S, no beat at all: a window of many intervals stays silent.
    deadline = time.monotonic() + 10
    # (A beat decided just before the bound may land a little later, on a loaded machine: a margin.)
    while hb.stuck_for() <= STALL_S + 0.2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    silent_from = beats.n
    time.sleep(20 * INTERVAL_S)
    assert beats.n == silent_from, (silent_from, beats.n)
    assert threading.main_thread().is_alive() and caller.is_alive()  # the process ran all along
    runner.release.set()
    caller.join(10)
    assert beats.grow_within(10)  # the pass returned: beating again
    assert hb.stuck_for() == 0.0


def test_passes_that_each_return_keep_it_beating_however_long_the_work():
    """Many short passes back to back for several times STALL_S: progress, not a hang."""
    runner = Runner()
    _, beats = started(runner)
    before = beats.n
    end = time.monotonic() + 3 * STALL_S
    while time.monotonic() < end:
        runner.forward(0)
    assert beats.grow_within(10)
    assert beats.n > before
