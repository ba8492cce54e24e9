"""``wcache serve --respawn``: a supervisor that owns the listening socket, one serving engine
worker and one spare, and promotes the spare when the serving worker dies.

The supervisor binds the socket once and never closes it while it runs, so a client that connects
while no worker accepts waits in the listen backlog instead of being refused. Each worker is a
fresh interpreter (``python -m wcache.engine.spare``) that inherits the socket (``pass_fds``),
imports torch and wcache, and waits without a CUDA context until it is promoted; a promoted spare
then creates its context, maps the weights from the daemon (or reads the checkpoint with the disk
load format) and accepts on the same socket. A new spare starts once the promoted one is ready.

Why a pre-started spare and not a fork server (Android's zygote forks its children from one
preloaded process): a CUDA context does not survive ``fork``, so a zygote must never touch CUDA,
and every worker would inherit whatever else it ran (threads, the allocator's state, open
descriptors). A fresh interpreter starts clean, as engine/supervisor.py's other ranks do; its only
costs are its own import, paid in the background while another worker serves, and one idle
process's host memory (docs/respawn.md measures it). The shape is gunicorn's arbiter (a master
that keeps the socket and replaces workers, with ``preload_app``'s imports done ahead) and
uvicorn's supervisors, with one spare instead of a pool.

Repeated deaths back off: a worker that dies before it is ready, or within ``STABLE_S`` of it,
counts as a crash in a row; the first promotion is immediate, each later one waits twice as long
as the one before (``BACKOFF_S`` up to ``BACKOFF_MAX_S``), and the ``MAX_DEATHS``-th crash in a row
ends the supervisor with exit status 1, so Kubernetes still sees a crash loop. A worker that exits
with status 2 before it is ready (a configuration error that a new worker would repeat) ends it
with status 2 at once, as a plain ``wcache serve`` would.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from wcache.engine.http_front import address_error
from wcache.engine.drain import SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S
from wcache.engine.server import EngineServer
from wcache.errors import RespawnError

log = logging.getLogger("wcache.respawn")

SPARE_ENV = "WCACHE_SPARE_SPEC"  # a worker's settings, as JSON (engine/spare.py)
STABLE_S = 10.0
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0
MAX_DEATHS = 5
STOP_GRACE_S = 10.0

STARTED = "Respawn supervisor pid {pid} listens on http://{host}:{port}; engine worker pid {worker} starts"
DIED = "Engine worker pid {pid} died ({cause}); {then}"
RESPAWNED = "Respawned: engine worker pid {pid} ready {seconds:.3f} s after worker pid {dead} died ({cause})"
SPARE_DIED = "Spare engine worker pid {pid} exited ({cause}); starting another"
STOPPING = "Received {signal}, stopping the engine workers"
STOPPED = "Respawn supervisor stopped"


def cause(returncode: int) -> str:
    """An exit as an operator reads it: ``signal SIGKILL`` or ``exit status 1``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every worker serves on (the same options as EngineServer's own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(EngineServer.request_queue_size)
    except OSError as e:
        sock.close()
        raise address_error(e, (host, port)) from None
    return sock


class Worker:
    """One engine worker process and the two pipes it is driven by (JSON lines, no pickle)."""

    def __init__(self, args, sock: socket.socket):
        control_r, self.control = os.pipe()
        self.status, status_w = os.pipe()
        spec = {"args": vars(args), "listen_fd": sock.fileno(), "control_fd": control_r, "status_fd": status_w,
                "parent_pid": os.getpid(), "log_level": args.log_level}
        env = dict(os.environ, **{SPARE_ENV: json.dumps(spec)})
        # Its own process group (in the same session, so a container runtime or tools/k8s_probe.py
        # still sees it): a terminal's Ctrl-C, or a signal to the supervisor's group, reaches the
        # supervisor alone, which stops the workers itself instead of racing their exits.
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.engine.spare"], env=env,
                                     pass_fds=(sock.fileno(), control_r, status_w), process_group=0)
        os.close(control_r)
        os.close(status_w)
        self.pid = self.proc.pid
        self.pending = b""
        self.eof = False
        self.ready_at: float | None = None

    def promote(self, answer_while_loading: bool) -> None:
        try:
            os.write(self.control, json.dumps({"answer_while_loading": answer_while_loading}).encode() + b"\n")
        except OSError:
            pass  # it died already: the death is handled like any other

    def events(self) -> list[dict]:
        """The lines it wrote since the last call; EOF (it exited, or is exiting) sets ``eof``."""
        data = os.read(self.status, 1 << 16)
        if not data:
            self.eof = True
            return []
        *lines, self.pending = (self.pending + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def exited(self) -> bool:
        if self.eof:  # its end of the pipe closed as it exited: wait for the exit to be reaped
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return self.proc.poll() is not None

    def signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for fd in (self.control, self.status):
            try:
                os.close(fd)
            except OSError:
                pass


class RespawnSupervisor:
    def __init__(self, args, sock: socket.socket):
        self.args, self.sock = args, sock
        self.serving: Worker | None = None
        self.spare: Worker | None = None
        self.deaths = 0  # crashes in a row
        self.death: tuple[float, int, str] | None = None  # (when, pid, cause) of the death being answered
        self.promote_at: float | None = None
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()

    def workers(self) -> list[Worker]:
        return [w for w in (self.serving, self.spare) if w is not None]

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.serving = Worker(self.args, self.sock)
            log.info(STARTED.format(pid=os.getpid(), host=self.args.host, port=self.args.port, worker=self.serving.pid))
            # The first worker answers /health 503 while it loads, as a plain `wcache serve` does.
            self.serving.promote(answer_while_loading=True)
            return self._loop()
        finally:
            self._stop_workers()
            self.sock.close()
            for s, h in old.items():
                signal.signal(s, h)
            log.info(STOPPED)

    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            log.info(STOPPING.format(signal=signal.Signals(signum).name))
        self.stopping = True
        os.write(self.wake_w, b"x")

    def _loop(self) -> int:
        while not self.stopping:
            timeout = 1.0
            if self.promote_at is not None:
                timeout = max(0.0, min(timeout, self.promote_at - time.monotonic()))
            fds = [w.status for w in self.workers() if not w.eof] + [self.wake_r]
            try:
                readable, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            if self.stopping:
                break
            for w in self.workers():
                if w.status in readable and not w.eof:
                    for event in w.events():
                        self._on_event(w, event)
            code = self._reap()
            if code is not None:
                return code
            if self.promote_at is not None and time.monotonic() >= self.promote_at:
                self._promote()
            s = self.serving
            if s is not None and s.ready_at is not None and time.monotonic() - s.ready_at >= STABLE_S:
                self.deaths = 0  # it served long enough: the next death starts a new count
        return 0

    def _on_event(self, w: Worker, event: dict) -> None:
        if event.get("event") != "ready" or w is not self.serving:
            return  # "spare" is logged by the spare itself
        w.ready_at = time.monotonic()
        if self.death is not None:
            when, dead, why = self.death
            log.info(RESPAWNED.format(pid=w.pid, seconds=w.ready_at - when, dead=dead, cause=why))
            self.death = None
        if self.spare is None:
            # Started only now: its import would compete for the CPU with the promotion.
            self.spare = Worker(self.args, self.sock)

    def _reap(self) -> int | None:
        for w in self.workers():
            if not w.exited():
                continue
            w.close()
            why = cause(w.proc.returncode)
            if w is self.spare:
                self.spare = None
                if self._count_crash(w, why):
                    return 1
                log.warning(SPARE_DIED.format(pid=w.pid, cause=why))
                self.spare = Worker(self.args, self.sock)
                continue
            self.serving = None
            if w.ready_at is None and w.proc.returncode == 2:
                log.error(RespawnError.CONFIG.format(pid=w.pid))
                return 2
            if self._count_crash(w, why):
                return 1
            now = time.monotonic()
            self.death = (now, w.pid, why)
            delay = 0.0 if self.deaths <= 1 else min(BACKOFF_S * 2 ** (self.deaths - 2), BACKOFF_MAX_S)
            self.promote_at = now + delay
            who = f"spare pid {self.spare.pid}" if self.spare else "a new worker (no spare yet)"
            then = f"promoting {who}"
            if delay:
                then += f" in {delay:g} s (crash {self.deaths} in a row; at {MAX_DEATHS} --respawn gives up)"
            log.warning(DIED.format(pid=w.pid, cause=why, then=then))
        return None

    def _count_crash(self, w: Worker, why: str) -> bool:
        """Count a death; True when it is the one too many."""
        quick = w.ready_at is None or time.monotonic() - w.ready_at < STABLE_S
        self.deaths = self.deaths + 1 if quick else 1
        if self.deaths >= MAX_DEATHS:
            log.error(RespawnError.GAVE_UP.format(deaths=self.deaths, stable=STABLE_S, cause=why))
            return True
        return False

    def _promote(self) -> None:
        self.promote_at = None
        w, self.spare = self.spare or Worker(self.args, self.sock), None
        self.serving = w
        w.promote(answer_while_loading=False)  # clients wait in the backlog until it is ready

    def _stop_workers(self) -> None:
        """SIGTERM to every worker (the serving one drains as a plain `wcache serve` does: /health
        503, accepting on the socket this supervisor still holds for --shutdown-delay, then its
        in-flight requests for up to --shutdown-timeout), SIGKILL to any still running STOP_GRACE_S
        after both."""
        workers = self.workers()
        for w in workers:
            w.signal(signal.SIGTERM)
        drain_s = getattr(self.args, "shutdown_delay", SHUTDOWN_DELAY_S) + getattr(self.args, "shutdown_timeout",
                                                                                  SHUTDOWN_TIMEOUT_S)
        deadline = time.monotonic() + drain_s + STOP_GRACE_S
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait()
            w.close()
        self.serving = self.spare = None


def run_respawn(args, loader_config) -> int:
    """``wcache serve --respawn``: check what a plain serve checks, listen, then supervise."""
    from wcache.engine.engine import rank_specs

    plan, _ = rank_specs(args, loader_config)
    if plan.world_size > 1:
        raise RespawnError(RespawnError.ONE_RANK.format(world=f"{plan.world_size} ranks", layout=plan.layout.describe()))
    return RespawnSupervisor(args, listen(args.host, args.port)).run()
