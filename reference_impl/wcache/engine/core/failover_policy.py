"""When a dead or hung engine is replaced, and when to stop trying: the numbers ``--respawn``'s two
shapes share, the supervisor that hands connections to workers (respawn/respawn.py) and the
front that replaces its engine cores (api_server/front_failover.py). The standard library only:
the supervisor imports neither torch nor the model.
"""

from __future__ import annotations

import signal

# The serving worker beats every BEAT_S (engine/respawn/heartbeat.py; a busy engine core's status frames, core_engine.py). The default bound: far above any one
# forward pass we run (a long prefill of an 8B model on an H200 takes well under a second; the
# beat thread also waits for the GIL behind it) and far below what a client or a probe waits for
# (Kubernetes' readiness probe: 3 s timeout, 3 failures in a row): 5 s.
BEAT_S = 0.1
HEARTBEAT_TIMEOUT_S = 5.0
STABLE_S = 10.0
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0
MAX_DEATHS = 5
SPARE_DELAY_S = 1.0  # after a respawn, the next spare starts this long after the promoted worker is ready


def cause(returncode: int) -> str:
    """An exit as an operator reads it: ``signal SIGKILL`` or ``exit status 1``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"
