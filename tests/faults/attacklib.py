"""Helpers of the attack tests: /proc probes of a live process (RSS, descriptors, threads) sampled
while an attack runs, and the figures the tests measure, which docs/faults.md shows.

Each figure is checked against the code's bound for it (BOUNDS) when it is measured, and again by
tests/docs/test_fault_record.py in the published record. The record, docs/faults-attacks.json, is
one run: written whole, with the run's commit and time, by a run of the attack tests (ATTACK_TESTS)
under WCACHE_WRITE_FIGURES=1 that measured every attack; never merged with an earlier run.
"""

from __future__ import annotations

import ast
import datetime
import json
import math
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

from wcache.daemon.rank import EMFILE_LOG_EVERY_S, IN_FLIGHT_BYTES, REQUEST_TIMEOUT_S
from wcache.engine.api_server.http_front import DEFAULT_LIMITS as HTTP
from wcache.wire.handback import ASK_BUDGET_S
from wcache.wire.protocol import MAX_FDS

ROOT = Path(__file__).resolve().parents[2]
FIGURES_FILE = ROOT / "docs" / "faults-attacks.json"
# The tests that measure attacks (each figure() call names one); a record holds all of them.
ATTACK_TESTS = (Path(__file__).with_name("test_fault_attacks.py"), Path(__file__).with_name("test_fault_http.py"))
RECORD_COMMAND = "WCACHE_WRITE_FIGURES=1 .venv/bin/python -m pytest " + " ".join(
    f"tests/faults/{p.name}" for p in ATTACK_TESTS)
WRITE_ENV = "WCACHE_WRITE_FIGURES"
FIGURES: dict[str, dict] = {}

# Allowances for the measurement itself, not for the code: each says what it covers.
CLOSE_SLACK_S = 0.5  # a thread waking after its deadline and closing a socket, on a busy machine
POLL_S = 3.0  # the 1 B/s sender sends a byte, then polls 1 s for the close, and sendall may block
HTTP_BUDGETS = HTTP.max_waiting_connections + HTTP.max_connections + HTTP.health_connections
THREADS_SLACK = 4  # the server's own threads (acceptor, logging) besides one per connection
FLOOD_SLACK_FDS = 16  # the last segment of a frame may carry up to MAX_FDS more before it is counted
AMPLIFICATION_MIB = 200  # 4 x 16 MiB frames held as bytes (+ allocator slack); was ~400 MiB each parsed

# attack -> [(the bound, as the code and the page state it; the check)]
BOUNDS: dict[str, list[tuple[str, object]]] = {
    "6 silent offers": [
        (f"asked_s <= ASK_BUDGET_S ({ASK_BUDGET_S:g}) + {CLOSE_SLACK_S}",
         lambda f: f["asked_s"] <= ASK_BUDGET_S + CLOSE_SLACK_S)],
    "a frame at 1 byte a second": [
        (f"closed_after_s <= REQUEST_TIMEOUT_S ({REQUEST_TIMEOUT_S:g}) + {POLL_S}",
         lambda f: f["closed_after_s"] <= REQUEST_TIMEOUT_S + POLL_S)],
    "half-sent HTTP bodies": [  # a thread per connection, bounded by the front door's budgets
        (f"threads_peak <= threads_before + min(connections + 1, {HTTP_BUDGETS}) + {THREADS_SLACK}",
         lambda f: f["threads_peak"] <= f["threads_before"] + min(f["connections"] + 1, HTTP_BUDGETS)
         + THREADS_SLACK)],
    "EMFILE on accept": [
        (f"1 <= log_lines <= one per EMFILE_LOG_EVERY_S ({EMFILE_LOG_EVERY_S:g}) + 1",
         lambda f: 1 <= f["log_lines"] <= math.ceil(f["seconds"] / EMFILE_LOG_EVERY_S) + 1)],
    "large frames in flight": [
        (f"rss_peak_mib - rss_before_mib <= IN_FLIGHT_BYTES ({IN_FLIGHT_BYTES >> 20} MiB)",
         lambda f: f["rss_peak_mib"] - f["rss_before_mib"] <= IN_FLIGHT_BYTES >> 20)],
    "memory amplification": [
        (f"rss_peak_mib - rss_before_mib < {AMPLIFICATION_MIB}",
         lambda f: f["rss_peak_mib"] - f["rss_before_mib"] < AMPLIFICATION_MIB)],
    "descriptor flood": [
        (f"fds_peak <= fds_before + flooders x (1 + 2 x MAX_FDS ({MAX_FDS})) + {FLOOD_SLACK_FDS}",
         lambda f: f["fds_peak"] <= f["fds_before"] + f["flooders"] * (1 + 2 * MAX_FDS) + FLOOD_SLACK_FDS)],
    "unread answers": [
        ("fds_peak <= fds_before + 2 x connections (a socket and one unread descriptor each)",
         lambda f: f["fds_peak"] <= f["fds_before"] + 2 * f["connections"])],
    "forged hand-back": [("adopted is false", lambda f: f["adopted"] is False)],
}


def bound_problems(attack: str, values: dict) -> list[str]:
    """The bounds of BOUNDS[attack] that these figures break (a missing figure breaks its bound)."""
    out = []
    for text, check in BOUNDS.get(attack, []):
        try:
            ok = check(values)
        except KeyError as e:
            ok, text = False, f"{text} (no figure {e})"
        if not ok:
            out.append(f"{attack}: {text} does not hold for {values}")
    return out


def measured_attacks(source: str | None = None) -> set[str]:
    """The attacks the attack tests record a figure for: the first argument of each figure()."""
    sources = [source] if source is not None else [p.read_text(encoding="utf-8") for p in ATTACK_TESTS]
    return {n.args[0].value for src in sources for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "figure"
            and n.args and isinstance(n.args[0], ast.Constant)}


def run_record(figures: dict[str, dict]) -> dict:
    """One run's record: when, at which commit, on what, and every attack's figures."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"run": {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain") else ""),
                    "command": RECORD_COMMAND,
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
            "attacks": dict(sorted(figures.items()))}


def publish() -> str | None:
    """At the end of a session (tests/faults/conftest.py): write this run's record over
    docs/faults-attacks.json, if asked to and if it is complete; else why not (None: not asked, or
    no attack test ran in this process, e.g. another pytest-xdist worker)."""
    if os.environ.get(WRITE_ENV) != "1" or not FIGURES:
        return None
    missing = measured_attacks() - set(FIGURES)
    if missing:
        return (f"{WRITE_ENV}=1: docs/faults-attacks.json not written, this run did not measure {sorted(missing)} "
                f"(a record is one whole run: {RECORD_COMMAND})")
    FIGURES_FILE.write_text(json.dumps(run_record(FIGURES), indent=2) + "\n")
    return None


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
    """Keep an attack's figures for this run's record, after checking them against the code's bounds."""
    values = {k: round(v, 2) if isinstance(v, float) else v for k, v in values.items()}
    problems = bound_problems(attack, values)
    assert not problems, problems
    FIGURES[attack] = values


def timed(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out
