"""The processes a bench measures, shared by its measurements: a real `wcache preload` daemon (the
handoff, the engine start, the restart and respawn all run beside one), and what a process costs the
host in memory. The engines under test are their measurements' own (start.py, respawn.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from wcache.bench.failure import bench_failure
from wcache.daemon.launcher import READY

START_TIMEOUT_S = 1800  # a daemon loading a large checkpoint from a cold disk


def quantization_flag(quantization: str | None) -> list[str]:
    """``--quantization`` for a daemon or an engine of the bench, when `wcache bench` was given one."""
    return ["--quantization", quantization] if quantization else []


class DaemonUnderTest:
    """A real `wcache preload` in a private socket directory, for the length of a measurement."""

    def __init__(self, model: str, device: str, dtype: str, socket_dir: Path, transport: str = "auto",
                 extra: tuple[str, ...] = (), log_name: str = "daemon.log", wait: bool = True,
                 quantization: str | None = None, env: dict | None = None):
        """Started, and unless ``wait`` is False (a standby: restart.py) READY."""
        self.socket_dir = socket_dir
        cmd = [sys.executable, "-m", "wcache.cli", "--log-level", "INFO", "preload", "--model", model,
               "--device", device, "--dtype", dtype, "--weight-cache-socket-dir", str(socket_dir),
               "--weight-cache-transport", transport, *quantization_flag(quantization), *extra]
        self.log_path = socket_dir.parent / log_name
        self.start = len(self.log_path.read_bytes()) if self.log_path.exists() else 0
        self.log = open(self.log_path, "ab")
        t0 = time.monotonic()
        # Its own session: a restart measurement kills the launcher and its ranks together.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        if wait:
            self.ready_s = self.wait_ready(t0)

    def wait_ready(self, since: float) -> float:
        """Seconds from ``since`` (monotonic) until this daemon logs READY."""
        deadline = time.monotonic() + START_TIMEOUT_S
        # Ready is the launcher's READY line: a killed daemon's socket file (and an engine's
        # hand-back offer) can lie in the directory before this daemon has bound anything.
        while READY not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                waited = START_TIMEOUT_S if self.proc.poll() is None else None
                waited and self.kill()
                raise bench_failure("the weight cache daemon's start", "daemon", self.text(),
                                    code=self.proc.returncode, waited_s=waited)
            time.sleep(0.01)
        return time.monotonic() - since

    def text(self) -> str:
        """What this daemon logged (the log file is shared by every daemon of the run)."""
        return self.log_path.read_bytes()[self.start:].decode(errors="replace")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self.log.close()


def terminate(proc: subprocess.Popen, session: bool = False, timeout: float = 60) -> int:
    """Stop an engine under test: SIGTERM, then SIGKILL (to its whole ``session``, where it leads
    one) if it has not exited within ``timeout`` seconds. Its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if session:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return proc.returncode


def rss_bytes(pid: int) -> int:
    """The resident set of ``pid`` (0 for a process that has none, a zombie)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a launcher and its ranks), as they are now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue
        out.append(p)
    return out


def tree_rss_bytes(pid: int) -> int:
    """The resident set of ``pid`` and its descendants (a launcher and its ranks); a process that
    exits meanwhile counts for nothing."""
    total = 0
    for p in tree_pids(pid):
        try:
            total += rss_bytes(p)
        except OSError:
            continue
    return total


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) ``pid`` and its living descendants have used so far."""
    ticks = 0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")