"""core/stop_flag.py: a signal handler that sets the stop flag never waits for its own thread.

The hang it fixes, made deterministic: a trace function sends the process SIGUSR1 while the main
thread is in the middle of ``set`` (for ``threading.Event``: holding the Event's lock), as a second
SIGTERM does when it arrives during the first one's handler. Python runs the handler at the next
bytecode, inside ``set``; the handler calls ``set`` again. With an Event that waits forever (the
first case proves this test can fail); with a StopFlag it returns. Each case runs in a fresh
interpreter with a timeout, since a hang cannot be undone in this one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import linecache, os, signal, sys, threading
    from wcache.core.stop_flag import StopFlag

    flag = {make}
    fired = []

    def handler(signum, frame):
        fired.append(signum)
        flag.set()  # the nested call: the outer set() has not returned yet

    def trace(frame, event, arg):
        # Inside the outer set(), at the line that sets the flag: an Event holds its lock there.
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if event == "line" and frame.f_code.co_name == "set" and "{marker}" in line and not fired:
            os.kill(os.getpid(), signal.SIGUSR1)
        return trace

    signal.signal(signal.SIGUSR1, handler)
    sys.settrace(trace)
    flag.set()
    sys.settrace(None)
    assert fired and flag.is_set() and flag.wait(0)
    print("returned")
""")


def run(make: str, marker: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(make=make, marker=marker)], capture_output=True,
                          text=True, timeout=timeout)


def test_an_event_set_from_a_handler_inside_set_waits_for_itself():
    """The bug as it was: the nested handler waits for the lock that the outer set() holds."""
    with pytest.raises(subprocess.TimeoutExpired):
        run("threading.Event()", "self._flag = True", timeout=5)


def test_a_stop_flag_set_from_a_handler_inside_set_returns():
    result = run("StopFlag()", "self._set = True", timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "returned", result.stderr


def test_wait_returns_when_set_from_another_thread_and_times_out_otherwise():
    import threading
    import time

    from wcache.core.stop_flag import StopFlag

    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.05) is False and time.monotonic() - t0 >= 0.05
    threading.Timer(0.05, flag.set).start()
    assert flag.wait(10) is True and time.monotonic() - t0 < 5
    assert flag.wait(0) is True and flag.wait() is True  # stays set: every later waiter returns at once
    flag.close()
    assert flag.is_set()
