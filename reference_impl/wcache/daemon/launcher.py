"""`wcache preload`: plan the local ranks, start one daemon process per rank, report readiness.

The launcher itself holds no weights, and imports no torch (nor the model): only its ranks need
them, and on a small host every replica that imported torch twice paid its CPU twice
(tests/integration/test_daemon.py checks the launcher's maps). It starts each rank as a fresh interpreter, waits for every
rank's "serving" line on a private pipe, logs ``Weight cache daemon READY`` and answers
``GET /health`` (200 only while every rank serves). A rank that dies during startup takes the
group down with its exit code; SIGINT/SIGTERM stops every rank, and each removes its socket.

With ``--weight-cache-standby`` a launcher that finds the device's lock held waits for it instead
of exiting 2 (a hot standby: its rank interpreters have imported already, so a restart, planned or
a crash, costs only the takeover; see docs/lifecycle.md).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from wcache.core import checkpoint_files, fp8_check, seeded_checkpoint
from wcache.core.config import EngineConfig, Ranks
from wcache.core.device import device_identity
from wcache.core.ranks import ParallelSettings, plan_daemons
from wcache.core.settings import ModelSettings
from wcache.core.stop_flag import StopFlag
from wcache.daemon import prewarm
from wcache.daemon.metrics import LauncherMetrics
from wcache.daemon.seed_settings import SeedSettings, preload_seed_settings
from wcache.errors import (
    STANDBY_STOPPED,
    STANDING_BY,
    TAKING_OVER,
    DaemonLockError,
    PreloadConfigError,
    SeedConfigError,
)
from wcache.model.quant import refuse_for_cache
from wcache.wire.sockets import (
    DaemonLock,
    claim_socket,
    clear_stale_socket,
    prepare_socket_dir,
    socket_path_for,
    socket_path_of,
)

log = logging.getLogger("wcache.preload")

STARTUP_FAILED = "Weight cache daemon rank(s) exited during startup (exitcodes={codes})"
READY = "Weight cache daemon READY"
STOP_TIMEOUT_INVALID = "--weight-cache-stop-timeout must be a positive number of seconds, not {value}"
RANK_KILLED = "Rank {rank} did not stop within {grace:.0f} s of SIGTERM; killed it (SIGKILL)"
DEAD_SOCKET_REMOVED = "Removed killed rank {rank}'s socket {path}: nothing listens there"
HEALTH_PORT_TAKEOVER_S = 5.0  # a standby's wait for the stopped daemon's health port to close


class Health:
    """What /health reports: 200 only while every rank is serving."""

    def __init__(self):
        self.ready = False
        self.failed = False

    @property
    def ok(self) -> bool:
        return self.ready and not self.failed


def start_health_server(host: str, port: int, health: Health, metrics: LauncherMetrics | None = None,
                        wait_s: float = 0.0) -> ThreadingHTTPServer:
    """Serve /health (and /metrics). ``wait_s``: how long to retry a port still in use (a standby
    taking over: the dead daemon's rank releases the lock before its launcher's socket is closed)."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/metrics" and metrics is not None:  # Prometheus (daemon/metrics.py)
                body, content_type = metrics.render_metrics()
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path != "/health":
                self.send_error(404)
                return
            status = 200 if health.ok else 503
            body = json.dumps({"status": "ready" if health.ok else ("failed" if health.failed else "starting")})
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    deadline = time.monotonic() + wait_s
    while True:
        try:
            server = ThreadingHTTPServer((host, port), Handler)
            break
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    log.info("Health endpoint on http://%s:%d/health", host, port)
    return server


@dataclass(frozen=True)
class PreloadSettings(ModelSettings):
    """`wcache preload`'s flags (add_preload_command_args in cli/flags.py), built once by the command
    line (core/settings.py); run_preload checks what the flags alone decide before any rank starts."""

    weight_cache_socket_dir: str | None = None
    weight_cache_health_port: int | None = None
    weight_cache_health_host: str = "0.0.0.0"
    weight_cache_transport: str = "auto"
    weight_cache_adopt: bool = True
    weight_cache_standby: bool = False
    weight_cache_stop_timeout: float = 30.0
    weight_cache_rehash: bool = False
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    seeding: SeedSettings = field(default_factory=SeedSettings)


def plan_local_ranks(settings: PreloadSettings, cfg):
    """This node's daemon ranks and groups (target, plus the draft with a cached speculative
    method), after validating the parallel flags; see ranks.py for the layout."""
    return plan_daemons(settings.parallel, cfg)


def _group_spec(spec: dict, group: dict, seed) -> dict:
    if group.get("draft"):  # upstream skips the autotune pass for draft groups
        return {**spec, **group, "autotune": False, "seed": None, "seed_listen": None}
    return {**spec, **group, "seed": seed}


def claim_rank_sockets(socket_dir, device: str, planned: list[Ranks], groups: list[dict],
                       on_wait=None) -> list[DaemonLock]:
    """The lock of every rank this launcher will start, in the order the ranks start, taken before
    any rank exists: a second `wcache preload` for a device stops here, in well under a second of its
    own work, having started no interpreter, read no weight and written no record. A standby
    (``on_wait``, called before the first wait) waits for each lock instead, in the same order, so
    that two standbys never hold a lock each that the other waits for."""
    d = prepare_socket_dir(socket_dir, create=True)
    locks: list[DaemonLock] = []
    try:
        for group in groups:
            for r in planned:
                path = socket_path_for(d, device_identity(device, r.local_rank), group.get("draft", False))
                locks.append(claim_socket(path, on_wait=on_wait))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


class RankProcess:
    def __init__(self, ranks: Ranks, spec: dict, lock: DaemonLock):
        self.ranks = ranks
        self.label = f"draft:{ranks.global_rank}" if spec.get("draft") else ranks.global_rank
        spec = {**spec, "ranks": asdict(ranks), "parent_pid": os.getpid(), "took_over": lock.waited}
        # The rank gets the lock's open file (and with it the flock) and learns who its parent is, so
        # that it can die with it (lifeline.py). This process keeps no copy of the lock: a rank that
        # dies releases its device at once, while the launcher still runs.
        waiting = prewarm.take()
        try:
            if waiting is not None:  # the interpreter started before the launcher's own imports
                waiting.hand({**spec, "ready_fd": waiting.ready_w, "spawned_at": waiting.spawned_at}, lock.fd)
                self.proc, r = waiting.proc, waiting.ready_r
            else:
                r, w = os.pipe()
                env = dict(os.environ, WCACHE_RANK_SPEC=json.dumps({**spec, "ready_fd": w, "lock_fd": lock.fd,
                                                                    "spawned_at": time.monotonic()}))
                try:
                    self.proc = subprocess.Popen([sys.executable, "-m", "wcache.daemon.rank"], env=env,
                                                 pass_fds=(w, lock.fd))
                finally:
                    os.close(w)
        finally:
            lock.release()
        self.ready_pipe = os.fdopen(r, "r")
        self.info: dict | None = None


def run_preload(settings: PreloadSettings) -> int:
    if settings.load_format == "ipc_cache":
        raise PreloadConfigError("--load-format ipc_cache cannot be used with `wcache preload`: "
                                 "the daemon itself must load the weights from disk")
    if not settings.weight_cache_stop_timeout > 0:  # also NaN
        raise PreloadConfigError(STOP_TIMEOUT_INVALID.format(value=settings.weight_cache_stop_timeout))
    cfg = EngineConfig.build(settings.model, settings.dtype, settings.quantization, settings.device,
                             revision=settings.revision)
    refuse_for_cache(cfg.quant)
    # Broken shards and FP8 values stop the launcher with their own line, before any rank starts. A
    # replica without shards that seeds its weights has none to check: the seed's digests check them.
    if seeded_checkpoint.has_shards(Path(cfg.model)) or not settings.seeding.weight_cache_seed:
        fp8_check.check(cfg.model, checkpoint_files.shard_files(cfg.model), cfg.quant)
    plan = plan_local_ranks(settings, cfg)
    log.info("Daemon plan: %s", plan.describe())
    planned = plan.layout.local_ranks()
    seeding = preload_seed_settings(settings.seeding)  # flags only: every check that needs no lock comes first
    seeds = seeding["seeds"]
    if seeds is not None and len(seeds) != len(planned):
        raise SeedConfigError(SeedConfigError.COUNT.format(given=len(seeds), ranks=len(planned)))
    stop = StopFlag()  # set by signal handlers: no lock (core/stop_flag.py)
    if settings.weight_cache_standby:
        locks = _stand_by(settings, cfg, plan, planned, stop)
        if locks is None:
            return 0
    else:
        locks = claim_rank_sockets(settings.weight_cache_socket_dir, cfg.device, planned, plan.groups)
    try:
        return _run_ranks(settings, cfg, plan, planned, locks, seeding, stop)
    finally:
        for lock in locks:
            lock.release()  # those not handed to a rank: an error before every rank started


class _StandbyStopped(Exception):
    pass


def _stand_by(settings: PreloadSettings, cfg, plan, planned, stop: StopFlag) -> list[DaemonLock] | None:
    """The locks of every rank, waiting for a running daemon to stop if one holds them; None when a
    stop signal came first. While it waits, every rank's interpreter has imported (prewarm.py) and
    nothing else has happened: no CUDA context, no weight read, no record, no socket, no port."""
    waiting = [True]

    def on_signal(signum, _frame):
        stop.set()
        if waiting[0]:
            raise _StandbyStopped(signal.Signals(signum).name)

    def on_wait(path) -> None:
        if not stop.is_set() and not getattr(on_wait, "said", False):  # once, at the first held lock
            prewarm.start(len(planned) * len(plan.groups))
            prewarm.wait_imported()
            log.info(STANDING_BY.format(path=path))
            on_wait.said = True

    # Once the locks are held the handler only sets ``stop``, as _run_ranks's own does: a signal
    # between the two never finds the interpreter's default handler.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        locks = claim_rank_sockets(settings.weight_cache_socket_dir, cfg.device, planned, plan.groups,
                                   on_wait)
        waiting[0] = False
    except _StandbyStopped as e:
        log.info(STANDBY_STOPPED.format(signal=e))
        return None
    if any(lock.waited for lock in locks):
        log.info(TAKING_OVER.format(path=", ".join(str(socket_path_of(lock.path)) for lock in locks if lock.waited)))
    return locks


def _run_ranks(settings: PreloadSettings, cfg, plan, planned, locks, seeding, stop: StopFlag) -> int:
    """Start a rank per lock (handing each its lock), report readiness, and stop them all at the end."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _f: stop.set())
    health = Health()
    metrics = LauncherMetrics(health, [lock.path for lock in locks])  # before the ranks: they write to it
    server = None
    if settings.weight_cache_health_port is not None:
        server = start_health_server(settings.weight_cache_health_host, settings.weight_cache_health_port, health,
                                     metrics, wait_s=HEALTH_PORT_TAKEOVER_S if any(lock.waited for lock in locks) else 0.0)

    spec = {"model": cfg.model, "dtype": settings.dtype, "quantization": settings.quantization, "device": cfg.device,
            "revision": settings.revision, "socket_dir": settings.weight_cache_socket_dir,
            "transport": settings.weight_cache_transport, "adopt": settings.weight_cache_adopt,
            "rehash": settings.weight_cache_rehash, "metrics_dir": metrics.directory,
            "log_level": logging.getLevelName(logging.getLogger().level)}
    t0 = time.perf_counter()
    spec.update(autotune=settings.enable_autotune, seed_listen=seeding["seed_listen"],
                seed_token=seeding["seed_token"], seed_weights=seeding["seed_weights"],
                seed_window_s=seeding["seed_window_s"], seed_round_replicas=seeding["seed_round_replicas"],
                seed_stall_s=seeding["seed_stall_s"])
    seeds = seeding["seeds"]
    ranks = []
    try:
        # The locks are in this order (claim_rank_sockets): each group, each of its ranks.
        for lock, (group, i, r) in zip(locks, [(g, i, r) for g in plan.groups for i, r in enumerate(planned)]):
            ranks.append(RankProcess(r, _group_spec(spec, group, seeds[i] if seeds else None), lock))
        code = _await_ready(ranks, stop)
        if code is None and not stop.is_set():
            health.ready = True
            sockets = ", ".join(r.info["socket"] for r in ranks)
            log.info("%s (%d rank(s) in %.1f s): %s", READY, len(ranks), time.perf_counter() - t0, sockets)
            while not stop.wait(0.2):
                dead = [r for r in ranks if r.proc.poll() is not None]
                if dead and not health.failed:
                    health.failed = True
                    log.error("Weight cache daemon rank(s) exited: %s; /health now answers 503",
                              {r.label: r.proc.returncode for r in dead})
                    for r in dead:  # after the line: the metrics' bookkeeping may first import prometheus_client
                        metrics.rank_exited(r.proc.pid)
    finally:
        killed = _stop_all(ranks, settings.weight_cache_stop_timeout)
        if server is not None:
            server.shutdown()
            server.server_close()
        metrics.close()
    # A rank that had to be killed did not stop cleanly: a supervisor sees it in the exit status.
    return code if code is not None else (1 if killed else 0)


def _await_ready(ranks: list[RankProcess], stop: StopFlag) -> int | None:
    """None when every rank serves (or a stop was asked); otherwise the exit code to leave with."""
    sel = selectors.DefaultSelector()
    for r in ranks:
        sel.register(r.ready_pipe, selectors.EVENT_READ, r)
    pending = set(ranks)
    while pending and not stop.is_set():
        for key, _ in sel.select(timeout=0.2):
            r = key.data
            line = r.ready_pipe.readline()
            sel.unregister(r.ready_pipe)
            if line:
                r.info = json.loads(line)
                pending.discard(r)
        exited = {r.label: r.proc.poll() for r in ranks if r.proc.poll() is not None}
        if exited:
            log.error(STARTUP_FAILED.format(codes=exited))
            first = next(iter(exited.values()))
            return first if first != 0 else 1
    sel.close()
    return None


def _stop_all(ranks: list[RankProcess], grace_s: float) -> bool:
    """SIGTERM every rank, SIGKILL those still alive after ``grace_s``; True if one was killed."""
    killed = False
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.terminate()
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
            killed = True
            log.error(RANK_KILLED.format(rank=r.label, grace=grace_s))
            if r.info is not None:
                _remove_dead_socket(r.label, Path(r.info["socket"]))
        r.ready_pipe.close()
    return killed


def _remove_dead_socket(label, path: Path) -> None:
    """A rank killed on stop never reached its own cleanup: remove its socket, so that the next
    engine finds no daemon instead of a dead one. Only under the socket's lock, taken without
    waiting (a standby may own the device already, and with it the path), and only where connecting
    is refused (wire/sockets.py, clear_stale_socket); anything else leaves the file alone."""
    lock = DaemonLock(path)
    try:
        lock.acquire()
        if clear_stale_socket(path):
            log.warning(DEAD_SOCKET_REMOVED.format(rank=label, path=path))
    except DaemonLockError as e:
        log.warning("Left rank %s's socket %s in place: %s", label, path, e)
    finally:
        lock.release()
