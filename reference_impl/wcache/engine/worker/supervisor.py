"""The serve process's other local engine ranks: start them, watch them, stop them.

Ranks 1..N-1 of this node are fresh interpreters (``python -m wcache.engine.worker.runner``, never a fork
of a process that ran torch) that get their settings as JSON in the environment. A rank that dies
while the engine starts takes the serve process down (it may be blocked in a collective that would
wait for the dead rank); one that dies later turns /health to 503.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from wcache.engine.worker.runner import SPEC_ENV

log = logging.getLogger("wcache.engine")

STOP_GRACE_S = 10.0
WORKERS_STARTUP_FAILED = "Engine worker rank(s) exited during startup (exitcodes={codes})"
WORKERS_EXITED = "Engine worker rank(s) exited (exitcodes={codes}); /health now answers 503"


def spawn_worker(spec: dict) -> subprocess.Popen:
    env = dict(os.environ, **{SPEC_ENV: json.dumps({**spec, "parent_pid": os.getpid()})})
    return subprocess.Popen([sys.executable, "-m", "wcache.engine.worker.runner"], env=env)


def stop_workers(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Supervisor(threading.Thread):
    """Starts this node's other engine ranks and watches them until ``stop``."""

    def __init__(self, specs: list[dict], server=None):
        super().__init__(daemon=True, name="wcache-supervisor")
        self.server = server
        self.procs = [spawn_worker(s) for s in specs]
        self.started_ok = False
        self.stopping = False
        if self.procs:
            self.start()

    def run(self) -> None:
        while not self.stopping:
            time.sleep(0.2)
            dead = {i + 1: p.returncode for i, p in enumerate(self.procs) if p.poll() is not None}
            if not dead or self.stopping:
                continue
            if not self.started_ok:
                log.error(WORKERS_STARTUP_FAILED.format(codes=dead))
                for p in self.procs:
                    if p.poll() is None:
                        p.terminate()
                code = next((c for c in dead.values() if c), 1)
                logging.shutdown()
                os._exit(code if code > 0 else 1)
            if self.server is not None:
                self.server.ready = False
            log.error(WORKERS_EXITED.format(codes=dead))
            return

    def abort(self) -> None:
        """This rank failed to start: take the others down with it."""
        self.stopping = True
        for p in self.procs:
            p.terminate()
        stop_workers(self.procs)

    def stop(self) -> None:
        """After rank 0 told them to stop: wait for them, then make sure."""
        self.stopping = True
        stop_workers(self.procs)


def start_local_ranks(runner, specs: list[dict], plan, health, start, on_fail=None) -> Supervisor:
    """Start this node's other ranks (watched, a dead one turning ``health.ready`` to False) while
    ``start()`` starts rank 0's own; on a node that does not drive the engine, follow rank 0 until
    it says stop, then exit. ``on_fail`` runs if ``start`` raises (the ranks are stopped first)."""
    from wcache.core.distributed import exit_after_collectives
    from wcache.engine.worker.runner import serve_requests

    supervisor = Supervisor(specs[1:], health)
    try:
        start()
    except BaseException:
        supervisor.abort()
        if on_fail is not None:
            on_fail()
        raise
    supervisor.started_ok = True
    if not plan.drives:
        log.info("Engine node %d ready: %d rank(s) follow engine rank 0 at %s", plan.layout.node_rank,
                 len(specs), plan.init_method)
        code = serve_requests(runner)
        supervisor.stop()
        exit_after_collectives(code)
    return supervisor
