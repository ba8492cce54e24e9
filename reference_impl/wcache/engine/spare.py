"""A ``wcache serve --respawn`` worker: a fresh interpreter that imports everything an engine
start needs, then waits, holding no CUDA context, until its supervisor (engine/respawn.py)
promotes it to serve.

Started as ``python -m wcache.engine.spare`` with its settings as JSON in ``WCACHE_SPARE_SPEC``: the
``wcache serve`` arguments, and three inherited descriptors: the listening socket, a control
pipe it reads its promotion from and a status pipe it writes its progress to (one JSON object a
line, no pickle). Once promoted it runs ``wcache serve``'s own start-up (engine.run_serve) with
the inherited socket: the same loaders, memory plan and autotune as a plain ``wcache serve``.
Only then does it create its CUDA context, so the import of torch and wcache (most of an engine's
start, see docs/respawn.md) is paid before the previous worker died, not after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys
import threading
import time

T0 = time.monotonic()

import torch  # noqa: E402  (the point of a spare: this import happens before it is needed)

from wcache import logs  # noqa: E402
from wcache.engine.engine import run_serve  # noqa: E402
from wcache.engine.loading import registry  # noqa: E402,F401  (every loader: disk, ipc_cache and their modules)
from wcache.engine.loading.config import parse_loader_config  # noqa: E402
from wcache.engine.loading.lease import CacheLease  # noqa: E402,F401
from wcache.engine.handed import HandedConnections  # noqa: E402
from wcache.engine.heartbeat import Heartbeat  # noqa: E402
from wcache.engine.respawn import BEAT_S, HEARTBEAT_TIMEOUT_S, SPARE_ENV  # noqa: E402
from wcache.engine.runner import die_with_parent  # noqa: E402
from wcache.engine.server import EngineServer  # noqa: E402,F401
from wcache.engine.supervisor import Supervisor  # noqa: E402,F401
from wcache.errors import UserError  # noqa: E402
from wcache.wire.transports import auto  # noqa: E402,F401

log = logging.getLogger("wcache.engine")

SPARE_READY = ("Spare engine worker pid {pid} ready: torch and wcache imported in {seconds:.2f} s, "
               "no CUDA context (CUDA initialized: {cuda})")
# A worker whose order was waiting when its imports were done (the first one, or one started when
# no spare was left) was never a spare: it says so.
PROMOTED_AT_ONCE = "Engine worker pid {pid}: torch and wcache imported in {seconds:.2f} s"


_STATUS_LOCK = threading.Lock()  # the heartbeat thread writes on the same pipe


def tell(status, **event) -> None:
    """One line to the supervisor (an empty one is a heartbeat); a supervisor that is gone takes
    us with it (PR_SET_PDEATHSIG)."""
    line = json.dumps(event) + "\n" if event else "\n"
    with _STATUS_LOCK:
        try:
            status.write(line)
            status.flush()
        except (BrokenPipeError, OSError):
            pass


def warm_up() -> None:
    """The first CPU operator call initializes torch's dispatcher and thread pool: pay it now."""
    with torch.inference_mode():
        (torch.ones(8, 8) @ torch.ones(8, 8)).sum().item()


def main() -> int:
    spec = json.loads(os.environ.pop(SPARE_ENV))
    logs.setup(spec["log_level"])
    die_with_parent(spec["parent_pid"])
    warm_up()
    status = os.fdopen(spec["status_fd"], "w", buffering=1)
    control = os.fdopen(spec["control_fd"], "r")
    cuda = torch.cuda.is_initialized()  # False: is_initialized() itself creates nothing
    seconds = time.monotonic() - T0
    waiting = select.select([control], [], [], 0)[0]
    log.info((PROMOTED_AT_ONCE if waiting else SPARE_READY).format(pid=os.getpid(), seconds=seconds, cuda=cuda))
    tell(status, event="spare", pid=os.getpid(), import_s=round(seconds, 3), cuda_initialized=cuda)
    line = control.readline()  # blocks until promoted; EOF: the supervisor stops
    if not line:
        return 0
    promoted = time.monotonic()
    order = json.loads(line)
    args = argparse.Namespace(**spec["args"])
    channel = socket.socket(fileno=spec["handoff_fd"])
    # Connections come from the supervisor (engine/handed.py), never from a listening socket: the
    # server listens on a private loopback port that nobody is told, so its accept never fires.
    sock = socket.create_server(("127.0.0.1", 0))
    timeout = float(getattr(args, "respawn_heartbeat_timeout", None) or HEARTBEAT_TIMEOUT_S)
    heartbeat = Heartbeat(lambda: tell(status), BEAT_S, stall_s=timeout / 2)

    def on_ready(engine, server) -> None:
        HandedConnections(channel, server).start()
        # Its stamps on CLOCK_MONOTONIC, which the supervisor's and a bench's share (respawn.TIMELINE).
        tell(status, event="ready", pid=os.getpid(),
             phases={"order_received": round(promoted, 6), "ready": round(time.monotonic(), 6)})
        heartbeat.watch(engine.runner)
        heartbeat.start()

    try:
        return run_serve(args, parse_loader_config(args.model_loader_extra_config), sock=sock,
                         answer_while_loading=order["answer_while_loading"], on_ready=on_ready)
    except UserError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
