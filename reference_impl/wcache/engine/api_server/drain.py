"""A SIGTERM's drain, in the order Kubernetes needs (docs/lifecycle.md#stopping-the-engine):

1. At once: ``/health`` answers 503, so the readiness probe fails and the endpoint is withdrawn.
2. For ``--shutdown-delay`` seconds (default 5): keep accepting and serving as before. Kubernetes
   sends SIGTERM and removes the pod from its Service's endpoints at the same time, and the
   removal takes seconds to reach every node's proxy and every load balancer; a pod that stopped
   accepting at once would refuse the connections still routed to it. Dynamo's default grace is
   5 s too.
3. Stop accepting, close idle keep-alive connections, and let what is in flight finish, for up to
   ``--shutdown-timeout`` seconds (default 30).
4. What is still running then is ended with an error: a non-streamed completion answers a 503
   in the OpenAI error shape, a stream gets an SSE ``data: {"error": ...}`` event and
   ``data: [DONE]``. Then the engine stops and the process exits 0.

A pod's ``terminationGracePeriodSeconds`` must cover delay + timeout and a margin for the engine's
own stop (the manifests in examples/ say 60 for 5 + 30).
"""

from __future__ import annotations

import logging
import time

from wcache.core.stop_flag import StopFlag
from wcache.engine.openai import template_sandbox
from wcache.errors import DRAIN_CUT, DRAIN_STARTED, DRAINED, DRAINING

log = logging.getLogger("wcache.server")

SHUTDOWN_DELAY_S = 5.0
SHUTDOWN_TIMEOUT_S = 30.0
CUT_GRACE_S = 5.0  # after the deadline: time for the cut requests to write their error and leave


def drain(server, signal_name: str, delay: float = SHUTDOWN_DELAY_S, timeout: float = SHUTDOWN_TIMEOUT_S,
          again: StopFlag | None = None) -> None:
    """Run steps 1 to 4 on ``server`` (an EngineServer); a second signal (``again``) skips the delay."""
    server.draining = True  # step 1: /health 503
    log.info(DRAIN_STARTED.format(signal=signal_name, delay=delay, timeout=timeout))
    if again is not None:
        again.wait(delay)
    else:
        time.sleep(delay)
    server.closing = True  # step 3: the next answer on any connection is its last
    server.shutdown()  # the accept loop stops
    server.socket.close()  # and new connections are refused (under --respawn: this worker's copy of it)
    conns = server.connections
    conns.close_idle()
    t0 = time.monotonic()
    log.info(DRAINING.format(n=conns.in_flight(), timeout=timeout))
    deadline = t0 + timeout
    while conns.in_flight() and time.monotonic() < deadline:
        conns.close_idle()  # a connection that answered its last request and waits for the next
        time.sleep(0.05)
    left = conns.in_flight()
    if left:
        log.warning(DRAIN_CUT.format(timeout=timeout, n=left))
        server.aborting.set()  # step 4: completions stop at their next token and answer the error
        template_sandbox.RUNNER.cut()  # and chat template renders stop at once
        conns.close_waiting()  # requests still arriving will not be served
        end = time.monotonic() + CUT_GRACE_S
        while conns.in_flight() and time.monotonic() < end:
            conns.close_idle()
            time.sleep(0.05)
    else:
        log.info(DRAINED.format(seconds=time.monotonic() - t0))
