"""The daemon's ``GET /metrics`` on its health port: what the ranks hold, hand out, adopt and refuse.

The ranks are processes of their own and the launcher answers the health port, so the ranks store
their values in prometheus_client's multiprocess mode, in a private directory the launcher makes and
names in each rank's spec (``metrics_dir``); the launcher's scrape sums the directory and adds its
live gauges (ready, standbys waiting). A rank that exits keeps its counters in the sum; its bytes
held leave it (``core.metrics.mark_dead``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from wcache.core import metrics as m
from wcache.core.background import Background
from wcache.core.metrics import Metric

RANK = ("rank", "device")
READY = Metric("wcache_daemon_ready", "gauge",
               "1 while every rank of this `wcache preload` serves (/health 200), 0 while they start or once one "
               "has exited.", live=True)
WEIGHTS_BYTES = Metric("wcache_daemon_weights_bytes", "gauge",
                       "Bytes of post-processed weights a rank holds on its device (0 once a copy-mode engine "
                       "released them).", RANK)
HANDOFFS = Metric("wcache_daemon_handoffs", "counter",
                  "Handoffs: get_state requests answered with the arena, by the mode the engine asked for.",
                  RANK + ("mode",))
ADOPTIONS = Metric("wcache_daemon_adoptions", "counter",
                   "Arenas a starting rank adopted from a running zero_copy engine instead of reading the disk.", RANK)
REFUSALS = Metric("wcache_daemon_refusals", "counter",
                  "Engine requests and connections refused, by reason (the refusal's error kind).", RANK + ("reason",))
SEED_SERVED = Metric("wcache_daemon_seed_requests_served", "counter",
                     "Autotune cache documents served to seeding replicas (--weight-cache-seed-listen).", ("rank",))
SEED_REFUSED = Metric("wcache_daemon_seed_requests_refused", "counter",
                      "Seed requests refused, by reason (token, rate_limited, busy, mismatch, ...).", ("rank", "reason"))
STANDBY_WAITING = Metric("wcache_daemon_standby_waiting", "gauge",
                         "Standby launchers (--weight-cache-standby) waiting for this daemon's device locks, from "
                         "the kernel's lock table.", live=True)

METRICS = [READY, WEIGHTS_BYTES, HANDOFFS, ADOPTIONS, REFUSALS, SEED_SERVED, SEED_REFUSED, STANDBY_WAITING]
MODES = ("zero_copy", "copy")
READY_TO_COUNT = None  # _get(None): build the metrics, return none
MAX_REASON = 32  # a reason label is an error kind; never let a peer's text become a label


class RankMetrics:
    """One rank's stored values. ``spec["metrics_dir"]`` puts them in the launcher's directory;
    without one (a rank started by hand or in a test) they are kept, unread, in this process.
    Built on a thread of their own, started with the rank (importing prometheus_client takes ~15 ms
    after torch): done while the rank loads, not on its way to serving nor in a handoff."""

    def __init__(self, spec: dict, rank: int, device: str):
        self.directory = spec.get("metrics_dir")
        self.rank, self.device = str(rank), device
        self._m: dict | None = None
        self._lock = threading.Lock()
        Background(self._get, READY_TO_COUNT)

    def _get(self, metric: Metric | None):
        with self._lock:
            if self._m is None:
                if self.directory:  # read by prometheus_client at its first import: this one
                    os.environ[m.MULTIPROC_ENV] = self.directory
                self._m = {x.name: m.build(x) for x in METRICS if not x.live}
                # Counters start at 0 (as Prometheus asks), and in multiprocess mode each value type's
                # file is opened by its first value: opened here, at start, a rank's descriptors stay
                # flat afterwards (the fault tests count them around a refusal or a kill).
                for mode in MODES:
                    self._m[HANDOFFS.name].labels(self.rank, self.device, mode)
                self._m[ADOPTIONS.name].labels(self.rank, self.device)
                self._m[WEIGHTS_BYTES.name].labels(self.rank, self.device)
        return self._m[metric.name] if metric is not None else None

    def serving(self, nbytes: int, adopted: bool) -> None:
        def count() -> None:
            self.weights(nbytes)
            if adopted:
                self._get(ADOPTIONS).labels(self.rank, self.device).inc()

        Background(count)

    def weights(self, nbytes: int) -> None:
        self._get(WEIGHTS_BYTES).labels(self.rank, self.device).set(nbytes)

    def handoff(self, mode) -> None:
        self._get(HANDOFFS).labels(self.rank, self.device, mode if mode in MODES else "zero_copy").inc()

    def refused(self, reason) -> None:
        self._get(REFUSALS).labels(self.rank, self.device, str(reason)[:MAX_REASON]).inc()

    def seed_answer(self, answer: dict) -> None:
        """Count one answer of the seed listener (a ping is neither served nor refused)."""
        if answer.get("ok"):
            if "doc" in answer:
                self._get(SEED_SERVED).labels(self.rank).inc()
        else:
            self._get(SEED_REFUSED).labels(self.rank, str(answer.get("error"))[:MAX_REASON]).inc()


class LauncherMetrics:
    """The launcher's side: the directory its ranks write to, and what its scrape renders."""

    def __init__(self, health, lock_paths: list[Path]):
        self.health = health
        self.lock_paths = list(lock_paths)
        self.directory = m.make_dir("wcache-metrics-")
        self._registry = None
        self._lock = threading.Lock()

    def render_metrics(self) -> tuple[bytes, str]:
        with self._lock:
            if self._registry is None:
                self._registry = m.new_registry(self.directory)
                self._registry.register(_LauncherLive(self))
        return m.render(self._registry)

    def rank_exited(self, pid: int) -> None:
        m.mark_dead(pid, self.directory)

    def close(self) -> None:
        m.remove_dir(self.directory)


class _LauncherLive:
    def __init__(self, lm: LauncherMetrics):
        self.lm = lm

    def collect(self):
        yield m.live_family(READY, [((), 1.0 if self.lm.health.ok else 0.0)])
        yield m.live_family(STANDBY_WAITING, [((), float(lock_waiters(self.lm.lock_paths)))])


def lock_waiters(lock_paths: list[Path], table: str = "/proc/locks") -> int:
    """Processes blocked on a flock of any of these files: a standby launcher waits in flock(LOCK_EX)
    on each lock its daemon holds (wire/sockets.DaemonLock). The kernel lists blocked requests in
    /proc/locks as ``N: -> FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF``; the device is in hex."""
    wanted = set()
    for p in lock_paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        wanted.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    if not wanted:
        return 0
    try:
        lines = Path(table).read_text().splitlines()
    except OSError:
        return 0
    pids = set()
    for line in lines:
        f = line.split()
        if len(f) < 7 or f[1] != "->" or f[2] != "FLOCK":
            continue
        try:
            major, minor, inode = f[6].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if key in wanted:
            pids.add(f[5])
    return len(pids)
