"""core/background.py: a thread started without the handshake, joined by its Event, and (when asked)
finished before the interpreter exits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from wcache.core.background import Background

# The main thread returns at once; the background function writes its file 0.3 s later.
EXITS_EARLY = """
import sys, time
from pathlib import Path
from wcache.core.background import Background
Background(lambda: (time.sleep(0.3), Path(sys.argv[1]).write_text("done")), finish_before_exit=sys.argv[2] == "1")
"""


def test_join_and_is_alive_follow_the_function():
    gate = threading.Event()
    bg = Background(gate.wait)
    assert bg.is_alive() and not bg.join(0.05)
    gate.set()
    assert bg.join(5) and not bg.is_alive()


def test_a_failing_function_still_ends_and_is_reported(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    bg = Background(lambda: 1 / 0)
    assert bg.join(5)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:  # reported just after the Event is set
        time.sleep(0.01)
    assert [type(s.exc_value) for s in seen] == [ZeroDivisionError]


def test_the_interpreter_waits_only_when_asked(tmp_path):
    for wait, expected in (("1", True), ("0", False)):
        out = tmp_path / f"wait-{wait}"
        subprocess.run([sys.executable, "-c", EXITS_EARLY, str(out), wait], check=True, timeout=30)
        time.sleep(0.5)  # a thread that outlived its interpreter would have written by now
        assert out.exists() is expected, wait
