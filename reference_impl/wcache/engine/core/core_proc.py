"""`wcache serve`'s engine core process: ``python -m wcache.engine.core.core_proc CHANNEL_FD [OWNER_DEATH_FD]``, started by the
front (engine/api_server/front.py) as a fresh interpreter (never a fork of the front), with its end of the
front's socket pair. Its first frame is ``Start``: its settings (settings.CoreSettings as msgpack: no
pickle, and not on the command line, where ``ps`` shows them), checked again here. Then the CUDA
context is made while torch imports (early_context.py), and the engine core runs (engine/core/core_engine.py).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from wcache import logs
from wcache.core import no_dump
from wcache.core.owner_death import OwnerDeath
from wcache.core.settings import from_data
from wcache.engine.core.settings import CoreSettings
from wcache.engine.worker import early_context
from wcache.engine.core.core_messages import ChannelError, Start, core_channel
from wcache.errors import UserError

log = logging.getLogger("wcache.engine")


def _ignore(_signum, _frame) -> None:
    pass


def main(argv: list[str]) -> int:
    no_dump.forbid()
    # Ctrl-C reaches the whole process group, and `timeout` or a test signals it too: the front
    # drains, then stops this process (Shutdown, or its channel's close), never a signal. A handler
    # that does nothing, not SIG_IGN: the ranks it starts get the default dispositions back at exec.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    if len(argv) > 1:  # held for this process's life: the front learns of its death from it (core/owner_death.py)
        OwnerDeath(int(argv[1])).hold()
    channel = core_channel(socket.socket(fileno=int(argv[0])))
    try:
        start = channel.recv()
    except ChannelError as e:
        logs.setup()
        log.error("%s", e)
        return 1
    if not isinstance(start, Start):  # the front is gone before it said what to serve
        return 1
    try:
        settings = from_data(CoreSettings, start.settings)
    except ValueError as e:  # a front of another version: say what differs
        logs.setup()
        log.error("%s", e)
        return 1
    logs.setup(settings.log_level)
    early_context.start(["serve", "--device", settings.engine.device])
    from wcache.engine.core.core_engine import (
        run_core,  # torch, while the driver makes the context
    )
    from wcache.engine.loading.config import parse_loader_config

    try:
        return run_core(settings, parse_loader_config(settings.model_loader_extra_config), channel)
    except UserError as e:
        # As `wcache serve` in one process prints it (its command line's logger): the same line either way.
        logging.getLogger("wcache.cli").error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
