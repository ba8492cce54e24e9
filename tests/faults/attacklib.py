"""Helpers of the attack tests: /proc probes of a live process (RSS, descriptors, threads) sampled
while an attack runs, and the figures the tests measure, which docs/faults.md shows.

The figures are written to docs/faults-attacks.json only when WCACHE_WRITE_FIGURES=1 (a run made to
refresh the guide); otherwise a test only checks its bounds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

FIGURES_FILE = Path(__file__).resolve().parents[2] / "docs" / "faults-attacks.json"
FIGURES: dict[str, dict] = {}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class Peak:
    """Samples a process's RSS, descriptors and threads every 20 ms while the block runs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.rss = self.fds = self.threads = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.rss = max(self.rss, rss_mib(self.pid))
                self.fds = max(self.fds, fds(self.pid))
                self.threads = max(self.threads, threads(self.pid))
            except OSError:
                pass
            time.sleep(0.02)

    def __enter__(self) -> "Peak":
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(2)


def figure(attack: str, **values) -> None:
    FIGURES[attack] = {k: round(v, 2) if isinstance(v, float) else v for k, v in values.items()}
    if os.environ.get("WCACHE_WRITE_FIGURES") == "1":
        try:
            old = json.loads(FIGURES_FILE.read_text())
        except (OSError, ValueError):
            old = {}
        old[attack] = FIGURES[attack]
        FIGURES_FILE.write_text(json.dumps(dict(sorted(old.items())), indent=2) + "\n")


def timed(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out
