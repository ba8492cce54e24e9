"""``wcache serve --respawn``: a supervisor that owns the listening socket, one serving engine
worker and one spare, and promotes the spare when the serving worker dies.

The supervisor binds the socket once and never closes it while it runs, so a client that connects
while no worker accepts waits in the listen backlog instead of being refused. Each worker is a
fresh interpreter (``python -m wcache.engine.respawn.spare``) that inherits the socket (``pass_fds``),
imports torch and wcache, and waits without a CUDA context until it is promoted; a promoted spare
then creates its context, maps the weights from the daemon (or reads the checkpoint with the disk
load format) and accepts on the same socket. A new spare starts once the promoted one is ready.

Why a pre-started spare and not a fork server (Android's zygote forks its children from one
preloaded process): a CUDA context does not survive ``fork``, so a zygote must never touch CUDA,
and every worker would inherit whatever else it ran (threads, the allocator's state, open
descriptors). A fresh interpreter starts clean, as engine/worker/supervisor.py's other ranks do; its only
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

The supervisor stays small: ``wcache serve --respawn`` parses and checks its flags as a plain serve
does (which imports torch), binds the port, then ``exec``s this module (``python -m
wcache.engine.respawn.respawn``) with the socket and its arguments: the same pid, a fresh image that
imports neither torch nor the model (the standard library, wcache.errors and wcache.logs), so it
holds tens of MB instead of an engine's hundreds. Keep it that way: no import of wcache.engine's
other modules here at module level (tests/integration/test_respawn.py checks /proc/PID/maps).

A hung worker is replaced (engine/respawn/heartbeat.py): the serving worker writes an empty line on its
status pipe every ``BEAT_S`` from a thread that stops beating when one forward pass has run for
half the bound; a serving worker silent for ``--respawn-heartbeat-timeout`` seconds is killed
with SIGKILL and replaced as after a crash.
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

from wcache import logs
from wcache.core import metrics, no_dump  # the standard library only (prometheus_client is the workers')
from wcache.engine.respawn import handoff
from wcache.engine.core.failover_policy import (  # noqa: F401 (the supervisor's importers read them here too)
    BACKOFF_MAX_S,
    BACKOFF_S,
    BEAT_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_DEATHS,
    SPARE_DELAY_S,
    STABLE_S,
    cause,
)
from wcache.core.settings import from_data, to_data
from wcache.engine.api_server.settings import HttpSettings, ServeSettings  # the drain's and policy's modules, no more
from wcache.engine.respawn.reception import Reception, answer_503
from wcache.errors import RespawnError

log = logging.getLogger("wcache.respawn")

SPARE_ENV = "WCACHE_SPARE_SPEC"  # a worker's settings, as JSON (engine/respawn/spare.py)
SUPERVISOR_ENV = "WCACHE_RESPAWN_SPEC"  # the exec'd supervisor's settings, as JSON (main() below)
LISTEN_BACKLOG = 128  # FrontDoorServer.request_queue_size: a burst (or a respawn) waits in the backlog
STOP_GRACE_S = 10.0

STARTED = "Respawn supervisor pid {pid} listens on http://{host}:{port}; engine worker pid {worker} starts"
DIED = "Engine worker pid {pid} died ({cause}); {then}"
RESPAWNED = "Respawned: engine worker pid {pid} ready {seconds:.3f} s after worker pid {dead} died ({cause})"
SPARE_DIED = "Spare engine worker pid {pid} exited ({cause}); starting another"
HUNG = ("Engine worker pid {pid} hung: no heartbeat for {seconds:.1f} s (--respawn-heartbeat-timeout {timeout:g}); "
        "killing it with SIGKILL")
HUNG_CAUSE = "killed as hung, SIGKILL"
BAD_FRAME = "Engine worker pid {pid} broke the handoff protocol ({error}); killing it with SIGKILL"
BAD_FRAME_CAUSE = "killed for a malformed handoff frame, SIGKILL"
# One line per respawn with the supervisor's stamps on CLOCK_MONOTONIC (system-wide on Linux, so a
# bench that killed the worker can line them up with its own): bench_respawn.py splits the kill to
# the next answer into phases with it.
TIMELINE = "Respawn timeline: {json}"
HELD = ("Engine worker pid {pid} held {again} request(s) not yet answered (handed to the next worker), {whole} "
        "answer(s) written whole, {cut} stream(s) ended with an error event, {closed} answer(s) cut with a closed "
        "connection")
STOPPING = "Received {signal}, stopping the engine workers"
STOPPED = "Respawn supervisor stopped"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every worker serves on (the same options as EngineServer's own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        from wcache.engine.api_server.http_front import address_error  # the check runs before the exec (run_respawn)

        raise address_error(e, (host, port)) from None
    return sock


class Worker:
    """One engine worker process, the two pipes it is driven by (JSON lines, no pickle) and the
    socket its connections are handed over (engine/respawn/handoff.py)."""

    def __init__(self, settings: ServeSettings, metrics_dir: str | None = None):
        control_r, self.control = os.pipe()
        self.status, status_w = os.pipe()
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel.settimeout(2.0)  # a send to a stopped worker does not hold the supervisor long
        self.frames = handoff.FrameReader(self.channel)
        spec = {"settings": to_data(settings), "handoff_fd": theirs.fileno(), "control_fd": control_r,
                "status_fd": status_w, "parent_pid": os.getpid()}
        env = dict(os.environ, **{SPARE_ENV: json.dumps(spec)})
        if metrics_dir:  # every worker adds to the same counters: they outlive a worker (engine/api_server/metrics.py)
            env[metrics.MULTIPROC_ENV] = metrics_dir
        # Its own process group (in the same session, so a container runtime or tools/k8s_probe.py
        # still sees it): a terminal's Ctrl-C, or a signal to the supervisor's group, reaches the
        # supervisor alone, which stops the workers itself instead of racing their exits.
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.engine.respawn.spare"], env=env,
                                     pass_fds=(theirs.fileno(), control_r, status_w), process_group=0)
        os.close(control_r)
        os.close(status_w)
        theirs.close()
        self.pid = self.proc.pid
        self.pending = b""
        self.eof = False
        self.eof_at: float | None = None  # when its status pipe closed: the kernel was closing its descriptors
        self.ready_at: float | None = None
        self.heard_at = time.monotonic()  # the last bytes on its status pipe (a beat is an empty line)
        self.hung: str | None = None  # why it was killed as hung, if it was
        self.promoted_at: float | None = None

    def promote(self, answer_while_loading: bool) -> None:
        self.promoted_at = time.monotonic()
        try:
            os.write(self.control, json.dumps({"answer_while_loading": answer_while_loading}).encode() + b"\n")
        except OSError:
            pass  # it died already: the death is handled like any other

    def events(self) -> list[dict]:
        """The lines it wrote since the last call; EOF (it exited, or is exiting) sets ``eof``."""
        data = os.read(self.status, 1 << 16)
        if not data:
            self.eof, self.eof_at = True, time.monotonic()
            return []
        self.heard_at = time.monotonic()
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

    def drain(self) -> list[dict]:
        """Every frame it sent before it died (read to EOF: its end closed with it)."""
        frames = []
        while not self.frames.eof:
            frames += self.frames.read()
        return frames

    def close(self) -> None:
        for fd in (self.control, self.status):
            try:
                os.close(fd)
            except OSError:
                pass
        self.channel.close()


class RespawnSupervisor:
    def __init__(self, settings: ServeSettings, sock: socket.socket, front_door: dict):
        self.settings, self.sock = settings, sock
        self.reception = Reception(sock, front_door["limits"], front_door["responses"])
        self.serving: Worker | None = None
        self.spare: Worker | None = None
        self.deaths = 0  # crashes in a row
        # (reaped when, pid, cause, status pipe closed when) of the death being answered
        self.death: tuple[float, int, str, float] | None = None
        self.promote_at: float | None = None
        self.spare_at: float | None = None  # when to start the next spare
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        self.heartbeat_timeout = settings.respawn_heartbeat_timeout
        self.metrics_dir = metrics.make_dir("wcache-metrics-")  # the workers' counters (engine/api_server/metrics.py)

    def _worker(self) -> Worker:
        return Worker(self.settings, self.metrics_dir)

    def workers(self) -> list[Worker]:
        return [w for w in (self.serving, self.spare) if w is not None]

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.serving = self._worker()
            log.info(STARTED.format(pid=os.getpid(), host=self.settings.http.host, port=self.settings.http.port, worker=self.serving.pid))
            # The first worker answers /health 503 while it loads, as a plain `wcache serve` does.
            self.serving.promote(answer_while_loading=True)
            return self._loop()
        finally:
            self._stop_workers()
            self.reception.close_all()
            self.sock.close()
            metrics.remove_dir(self.metrics_dir)
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
            timeout = BEAT_S  # the serving worker's heartbeat is checked at least this often
            if self.promote_at is not None:
                timeout = max(0.0, min(timeout, self.promote_at - time.monotonic()))
            fds = [w.status for w in self.workers() if not w.eof] + [self.wake_r]
            fds += [w.channel for w in self.workers() if not w.frames.eof] + self.reception.fds()
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
                if w.channel in readable and not w.frames.eof:
                    self._heed(w, w.frames.read)
            self.reception.readable(readable)
            self.reception.tick()
            self._check_heartbeat()
            code = self._reap()
            if code is not None:
                return code
            if self.promote_at is not None and time.monotonic() >= self.promote_at:
                self._promote()
            if self.spare_at is not None and time.monotonic() >= self.spare_at:
                self.spare_at = None
                if self.spare is None:
                    self.spare = self._worker()
            s = self.serving
            if s is not None and s.ready_at is not None and time.monotonic() - s.ready_at >= STABLE_S:
                self.deaths = 0  # it served long enough: the next death starts a new count
        return 0

    def _heed(self, w, frames) -> None:
        """Apply what worker ``w`` says (``frames()``). A worker that breaks the protocol (a bug, or
        a process that is no longer the engine) is killed and replaced as after a crash: its
        connections are handled as a dead worker's, and nothing more it sent is read."""
        try:
            for frame in frames():
                self.reception.on_frame(w, frame)
        except handoff.BadFrame as e:
            if w.hung is None:
                log.error(BAD_FRAME.format(pid=w.pid, error=e))
                w.hung = BAD_FRAME_CAUSE
                w.signal(signal.SIGKILL)

    def _check_heartbeat(self) -> None:
        """SIGKILL a ready serving worker that has been silent longer than the bound: SIGSTOPped,
        or stuck in one forward pass (engine/respawn/heartbeat.py). Its exit is then reaped as a crash."""
        w = self.serving
        if w is None or w.ready_at is None or w.eof or w.hung is not None:
            return
        silent = time.monotonic() - max(w.heard_at, w.ready_at)
        if silent <= self.heartbeat_timeout:
            return
        log.warning(HUNG.format(pid=w.pid, seconds=silent, timeout=self.heartbeat_timeout))
        w.hung = HUNG_CAUSE
        w.signal(signal.SIGKILL)  # a stopped process dies of SIGKILL too; reaped below as a crash

    def _on_event(self, w: Worker, event: dict) -> None:
        if event.get("event") == "waiting":  # its loader waits for the weight cache daemon, or no longer
            self.reception.set_waiting(event.get("health"))
            return
        if event.get("event") != "ready" or w is not self.serving:
            return  # "spare" is logged by the spare itself
        w.ready_at = time.monotonic()
        if self.death is not None:
            when, dead, why, eof = self.death
            log.info(RESPAWNED.format(pid=w.pid, seconds=w.ready_at - when, dead=dead, cause=why))
            log.info(TIMELINE.format(json=json.dumps({
                "dead_pid": dead, "pid": w.pid, "exit_seen": round(eof, 6), "death_seen": round(when, 6),
                "promoted": round(w.promoted_at or when, 6), "worker": event.get("phases", {}),
                "ready_seen": round(w.ready_at, 6)})))
            self.death = None
        self.reception.worker_ready(w)  # connections that waited for a worker are handed now
        if self.spare is None:
            # Not now: its import (seconds of CPU) would compete with the first answers of the
            # promoted worker, which bench --respawn saw as most of the kill to the next 200.
            self.spare_at = time.monotonic() + (SPARE_DELAY_S if self.deaths else 0.0)

    def _reap(self) -> int | None:
        for w in self.workers():
            if not w.exited():
                continue
            w.close()
            why = w.hung or cause(w.proc.returncode)
            if w is self.spare:
                self.spare = None
                if self._count_crash(w, why):
                    return 1
                log.warning(SPARE_DIED.format(pid=w.pid, cause=why))
                self.spare = self._worker()
                continue
            self.serving = None
            self._heed(w, w.drain)  # what it said before it died: which answers it had begun
            again, whole, cut, closed = self.reception.worker_died(
                w, RespawnError.STREAM_CUT.format(pid=w.pid, cause=why))
            if w.ready_at is None and w.proc.returncode == 2:
                log.error(RespawnError.CONFIG.format(pid=w.pid))
                return 2
            if self._count_crash(w, why):
                return 1
            now = time.monotonic()
            self.death = (now, w.pid, why, w.eof_at or now)
            delay = 0.0 if self.deaths <= 1 else min(BACKOFF_S * 2 ** (self.deaths - 2), BACKOFF_MAX_S)
            self.promote_at = now + delay
            who = f"spare pid {self.spare.pid}" if self.spare else "a new worker (no spare yet)"
            then = f"promoting {who}"
            if delay:
                then += f" in {delay:g} s (crash {self.deaths} in a row; at {MAX_DEATHS} --respawn gives up)"
            log.warning(DIED.format(pid=w.pid, cause=why, then=then))
            if again or whole or cut or closed:
                log.warning(HELD.format(pid=w.pid, again=again, whole=whole, cut=cut, closed=closed))
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
        w, self.spare = self.spare or self._worker(), None
        self.serving = w
        w.promote(answer_while_loading=False)  # clients wait in the backlog until it is ready

    def _stop_workers(self) -> None:
        """SIGTERM to every worker (the serving one drains as a plain `wcache serve` does: /health
        503, answering what this supervisor hands it for --shutdown-delay, then its
        in-flight requests for up to --shutdown-timeout), SIGKILL to any still running STOP_GRACE_S
        after both."""
        workers = self.workers()
        for w in workers:
            w.signal(signal.SIGTERM)
        drain_s = self.settings.http.shutdown_delay + self.settings.http.shutdown_timeout
        deadline = time.monotonic() + drain_s + STOP_GRACE_S
        # The supervisor holds the connections: it goes on handing requests to the draining worker
        # (which answers /health 503 and serves what comes during --shutdown-delay) until it exits.
        while any(w.proc.poll() is None for w in workers) and time.monotonic() < deadline:
            live = [w for w in workers if not w.frames.eof]
            try:
                ready, _, _ = select.select([w.channel for w in live] + self.reception.fds(), [], [], 0.05)
            except InterruptedError:
                continue
            for w in live:
                if w.channel in ready:
                    self._heed(w, w.frames.read)
            self.reception.readable(ready)
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait()
            w.close()
        self.serving = self.spare = None


def run_respawn(settings: ServeSettings, loader_config) -> int:
    """``wcache serve --respawn``: check what a plain serve checks (torch and the engine imported),
    listen, then replace this process's image with the small supervisor (``main``), same pid."""
    from wcache.engine.core.engine import rank_specs

    plan, _ = rank_specs(settings.engine, loader_config)
    if plan.world_size > 1:
        raise RespawnError(RespawnError.ONE_RANK.format(world=f"{plan.world_size} ranks", layout=plan.layout.describe()))
    sock = listen(settings.http.host, settings.http.port)
    exec_supervisor(settings, sock, front_door(settings.http))
    return 1  # not reached: exec does not return


def front_door(http: HttpSettings) -> dict:
    """The front door's limits and the answers the supervisor gives itself (a 503 while busy or
    while the first worker loads), rendered with the engine's own texts before the exec."""
    import dataclasses

    from wcache.engine.openai import openai_api as api
    from wcache.engine.api_server import http_front, server
    from wcache.errors import BUSY_MESSAGE, LOADING

    working = http.max_concurrent_connections
    limits = dataclasses.asdict(server.Limits(max_connections=working)) | {"max_body": server.MAX_BODY_BYTES}
    # The supervisor holds every connection, working or waiting: the front door's two budgets together.
    limits["max_connections"] = working + limits.get("max_waiting_connections", 0)

    def render(payload: dict, retry: bytes = b"") -> str:
        return handoff.encode(answer_503(payload, retry))

    return {"limits": limits, "responses": {
        "busy": render(api.error_body(503, BUSY_MESSAGE.format(max=working)),
                       b"Retry-After: %d\r\n" % http_front.BUSY_RETRY_AFTER_S),
        "loading": render(api.error_body(503, LOADING)), "health_loading": render({"status": "loading"}),
        "error_type": "InternalServerError"}}  # vLLM's type for a 500


def exec_supervisor(settings: ServeSettings, sock: socket.socket, door: dict) -> None:
    """``exec`` ``python -m wcache.engine.respawn.respawn`` with the listening socket (inherited by number)."""
    os.set_inheritable(sock.fileno(), True)
    spec = {"settings": to_data(settings), "listen_fd": sock.fileno(), "front_door": door}
    env = dict(os.environ, **{SUPERVISOR_ENV: json.dumps(spec)})
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # The original command line follows (ignored by main): ps, a probe harness or an operator still
    # sees `wcache serve ... --respawn` in this pid's command line.
    os.execve(sys.executable, [sys.executable, "-m", "wcache.engine.respawn.respawn", "--", *sys.argv], env)


def main() -> int:
    """The supervisor after the exec: the standard library, wcache.errors and wcache.logs only."""
    no_dump.forbid()  # the exec set the flag back; the listening socket and the API key: see core/no_dump.py
    spec = json.loads(os.environ.pop(SUPERVISOR_ENV))
    settings = from_data(ServeSettings, spec["settings"])  # checked again: the exec'd image is a new program
    logs.setup(settings.core.log_level)
    sock = socket.socket(fileno=spec["listen_fd"])
    os.set_inheritable(sock.fileno(), False)  # only the supervisor accepts (engine/respawn/reception.py)
    door = spec["front_door"]
    responses = {k: (handoff.decode(v) if k != "error_type" else v) for k, v in door["responses"].items()}
    try:
        return RespawnSupervisor(settings, sock, {"limits": door["limits"], "responses": responses}).run()
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
