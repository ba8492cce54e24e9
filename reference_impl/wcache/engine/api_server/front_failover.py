"""`wcache serve --respawn` as front and engine core (the default layout): the
front keeps every connection and replaces its cores. A spare core is started ahead (Start, Planned,
Proceed(spare): it loads the weights, runs a warm-up forward and says Prepared) and is left unread
until the serving core dies. Only then is it told Promote: it sizes and allocates its KV cache in the
memory the dead core left and says Ready (two KV caches, each sized to the free memory, would not fit
one GPU). core_client.py hands it every request in flight with the token ids already sent
(AddRequest's ``output_token_ids``) and the streams go on where they stopped. Then a new spare starts.

Why here and not the old supervisor's design (engine/respawn/respawn.py): the front writes every byte of
every answer and knows each request's tokens, so nothing a client holds is lost with a core; the
supervisor there only held sockets, and a stream whose answer had begun ended with an error.

Back-off and give-up as that supervisor's: a spare that fails to load is started again after
BACKOFF_S, doubling up to BACKOFF_MAX_S; MAX_DEATHS deaths in a row, each within STABLE_S of the
promotion before it (or MAX_DEATHS spares in a row that never loaded), and the front gives up: the
requests in flight fail and it exits with the core's status, as without --respawn. No torch here.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from wcache.engine.core.core_messages import (
    ChannelError,
    Planned,
    Prepared,
    Proceed,
    Promote,
    Ready,
    Shutdown,
    Waiting,
    front_channel,
)
from wcache.engine.core.failover_policy import (
    BACKOFF_MAX_S,
    BACKOFF_S,
    BEAT_S,
    MAX_DEATHS,
    SPARE_DELAY_S,
    STABLE_S,
    cause,
)
from wcache.engine.core.settings import CoreSettings
from wcache.errors import (
    CORE_GAVE_UP,
    CORE_HUNG,
    CORE_SPARE_FAILED,
    CORE_SPARE_READY,
)

log = logging.getLogger("wcache.engine")

SPARE_STOP_S = 30.0  # a spare told to stop (the front drains and exits) has this long before SIGKILL


@dataclass
class Core:
    """An engine core the front started: its process, its channel and its Ready (once promoted)."""

    proc: subprocess.Popen
    channel: object
    ready: Ready | None = None


class Failover:
    def __init__(self, settings: CoreSettings, spawn):
        self.settings, self.spawn = settings, spawn  # spawn: core_client.spawn_core
        self.spare: Core | None = None
        self._starting: subprocess.Popen | None = None
        self._cv = threading.Condition()
        self._failed = 0  # spares in a row that never said Ready
        self._row = 0  # deaths in a row: each within STABLE_S of the promotion before it
        self._promoted_at: float | None = None
        self.closed = self.gave_up = False

    # -- spares ----------------------------------------------------------------------------------
    def start_spare(self, delay: float = 0.0) -> None:
        threading.Thread(target=self._spare, args=(delay,), name="wcache-spare-core", daemon=True).start()

    def _spare(self, delay: float) -> None:
        while True:
            if delay:
                time.sleep(delay)
            with self._cv:
                if self.closed:
                    return
                proc, sock = self.spawn(self.settings)
                self._starting = proc
            core = self._load(proc, front_channel(sock))
            with self._cv:
                self._starting = None
                if core is not None:
                    self._failed, self.spare = 0, core
                    self._cv.notify_all()
                    if self.closed:
                        self._stop(core)
                    else:
                        log.info(CORE_SPARE_READY.format(pid=proc.pid))
                    return
                if self.closed:
                    return
                self._failed += 1
                log.error(CORE_SPARE_FAILED.format(pid=proc.pid, cause=cause(proc.wait()), n=self._failed,
                                                   limit=MAX_DEATHS))
                if self._failed >= MAX_DEATHS:
                    self.gave_up = True
                    self._cv.notify_all()
                    return
                delay = min(BACKOFF_S * 2 ** (self._failed - 1), BACKOFF_MAX_S)

    @staticmethod
    def _load(proc: subprocess.Popen, channel) -> Core | None:
        """Planned, Proceed(spare), Prepared: the spare loads all but its KV cache and is then left
        unread until promoted."""
        try:
            planned = channel.recv()
            if isinstance(planned, Planned) and planned.drives:
                channel.send(Proceed(spare=True))
                msg = channel.recv()
                while isinstance(msg, Waiting):  # a spare's wait for the daemon: the serving core's /health stays
                    msg = channel.recv()
                if isinstance(msg, Prepared):
                    return Core(proc, channel)
        except (ChannelError, OSError) as e:
            log.error("%s", e)
        proc.kill()
        proc.wait()
        return None

    # -- the serving core died (core_client.py's reader thread) ----------------------------------
    def promote(self, dead_pid: int, reap) -> Core | None:
        """The spare to serve in place of the dead core (waiting for it if it still loads), or None
        once the front gives up. ``reap()``: the dead core's exit status, once the kernel has it
        (the caller logs the promotion with it, after the requests are handed on)."""
        now = time.monotonic()
        soon = self._promoted_at is not None and now - self._promoted_at < STABLE_S
        self._row = self._row + 1 if soon else 1
        if self._row >= MAX_DEATHS:  # the MAX_DEATHS-th in a row, as respawn.py counts
            log.error(CORE_GAVE_UP.format(pid=dead_pid, cause=cause(reap()), n=self._row, stable=STABLE_S))
            return None
        while True:
            with self._cv:
                while self.spare is None and not (self.gave_up or self.closed):
                    if self._starting is None:  # none under way (its start failed earlier): one now
                        self.start_spare()
                        self._starting = True
                    self._cv.wait(0.5)
                core, self.spare = self.spare, None
            if core is None:
                return None
            if self._allocate(core):
                break
            with self._cv:  # it died allocating: counted as a spare that never loaded; the next one
                self._failed += 1
                log.error(CORE_SPARE_FAILED.format(pid=core.proc.pid, cause=cause(core.proc.returncode),
                                                   n=self._failed, limit=MAX_DEATHS))
                if self._failed >= MAX_DEATHS:
                    self.gave_up = True
                    return None
        self._promoted_at = time.monotonic()
        self.start_spare(SPARE_DELAY_S)
        return core

    @staticmethod
    def _allocate(core: Core) -> bool:
        """Promote: the spare sizes and allocates its KV cache now, then says Ready (False: it died)."""
        try:
            core.channel.send(Promote())
            while True:
                msg = core.channel.recv()
                if msg is None or isinstance(msg, Ready):
                    break
        except (ChannelError, OSError) as e:
            log.error("%s", e)
            msg = None
        if isinstance(msg, Ready):
            core.ready = msg
            return True
        core.proc.kill()
        core.proc.wait()
        core.channel.close()
        return False

    # -- a stopped or hung core (its channel stays open) -------------------------------------------
    def watch(self, client, timeout: float) -> None:
        """Kill the serving core once it has sent nothing for ``timeout`` while requests are in
        flight (a busy core beats every BEAT_S, core_engine.report_status): its channel then closes
        and the spare takes over as after a crash."""
        def run() -> None:
            while not self.closed:
                time.sleep(BEAT_S)
                silent, proc = time.monotonic() - client.heard, client.proc
                if silent > timeout and client.in_flight() and proc.poll() is None and not client.closed:
                    log.error(CORE_HUNG.format(pid=proc.pid, seconds=silent, timeout=timeout))
                    proc.send_signal(signal.SIGKILL)
                    client.heard = time.monotonic()  # once per silence
        threading.Thread(target=run, name="wcache-core-watch", daemon=True).start()

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        with self._cv:
            self.closed = True
            spare, self.spare = self.spare, None
            starting = self._starting
        if spare is not None:
            self._stop(spare)
        if isinstance(starting, subprocess.Popen):  # still loading: nothing to drain
            starting.kill()
            starting.wait()

    @staticmethod
    def _stop(core: Core) -> None:
        stop_core(core.channel, core.proc, SPARE_STOP_S)


def stop_core(channel, proc: subprocess.Popen, timeout: float, ask: bool = True) -> None:
    """Stop an engine core: ``Shutdown`` on its channel (unless ``ask`` is False: it is gone), up to
    ``timeout`` for it to exit, then SIGKILL (logged); its channel closed either way."""
    if ask:
        try:
            channel.send(Shutdown())
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.error("The engine core (pid %d) did not stop in %.0f s: killed", proc.pid, timeout)
        proc.kill()
        proc.wait()
    channel.close()
