"""`wcache serve` as two processes (the default; ``WCACHE_ENABLE_V1_MULTIPROCESSING=0`` runs one), as vLLM V1 runs: this
one, the front, owns the listening socket and every client connection, tokenizes, detokenizes,
applies stop strings and writes every byte of every answer; the engine core (engine/core/core_proc.py)
owns the device, the weights, the KV cache and the scheduler. The front imports no torch.

Start-up: the front reads what it serves (names, tokenizer, chat template, API key: a bad one stops
here, before the core starts), starts the core, and binds once the core says this node holds engine
rank 0 (a node of a multi-node engine that does not only waits for its core). ``/health`` answers
503 until the core has loaded. The core's death is seen at once (its channel closes): requests in
flight fail, ``/health`` answers 503 and the front exits with the core's status; with --respawn
a spare core takes over and they go on (engine/api_server/front_failover.py). SIGTERM drains here
(engine/api_server/drain.py), then stops the core.
"""

from __future__ import annotations

import logging
import os
import threading

from wcache.engine.api_server.core_client import EngineCoreClient, spawn_core
from wcache.engine.api_server.settings import ServeSettings
from wcache.errors import MultiprocessingEnvError

log = logging.getLogger("wcache.engine")

ENV = "WCACHE_ENABLE_V1_MULTIPROCESSING"
DEATH_GRACE_S = 2.0  # after the core died: how long the requests in flight get to write their error


def enabled() -> bool:
    """Whether `wcache serve` runs as front and core: unless the variable is 0, as vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING defaults to 1. With --respawn the front then replaces dead cores
    itself (engine/api_server/front_failover.py); with 0, --respawn is the older supervisor's
    (engine/respawn/respawn.py). Any other value is refused: a typo must not pick a layout silently."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise MultiprocessingEnvError(MultiprocessingEnvError.VALUE.format(value=value))
    return value == "1"


def run_front(settings: ServeSettings) -> int:
    from wcache.core.config import model_config
    from wcache.engine.api_server.served import ServedModel
    from wcache.engine.api_server.server import EngineServer, run_until_signal

    # The checkpoint's config first, as one process refuses it (run_serve's rank_specs reads it before
    # the tokenizer): an unsupported model is named as such, not as a directory without a tokenizer.
    model_config(settings.model, settings.core.engine.dtype)
    # Names, chat template, API key: a bad one stops before loading.
    served = ServedModel.from_settings(settings.model, settings.api)
    proc, sock = spawn_core(settings.core)
    client = EngineCoreClient(proc, sock, served.tokenizer, served.stop_ids)
    try:
        planned = client.planned()
        if planned is None:  # the core refused the flags (its own log line says why)
            return client.exit_code()
        if not planned.drives:  # another node serves HTTP: this one's ranks follow it
            client.proceed()
            code = proc.wait()
            return code if code >= 0 else 1
        server = EngineServer.from_settings(settings.http, served, None)
    except BaseException:  # the port taken, say: the core has waited, silent, for Proceed
        proc.kill()
        proc.wait()
        raise
    client.proceed()
    log.info("Serving on http://%s:%d (health 503 until the engine core has loaded)", settings.http.host,
             settings.http.port)
    served.log_found()
    client.on_unhealthy = lambda: setattr(server, "ready", False)
    died = threading.Event()

    def on_death() -> None:  # the reader thread: the core's channel closed while we did not stop it
        server.ready = False
        died.set()
        # The requests in flight write their error first; then serving stops and the front exits.
        threading.Timer(DEATH_GRACE_S, server.shutdown).start()

    client.on_death = on_death
    ready = client.wait_ready()
    if ready is None:
        server.server_close()
        return client.exit_code()
    server.engine, server.ready = client, True
    server.metrics.engine_ready(client)
    if settings.core.respawn:  # a spare core loads now, to take over at the serving one's death
        from wcache.engine.api_server.front_failover import Failover

        client.on_promoted = lambda ready: server.metrics.core_promoted(ready.report, ready.load_format)
        client.failover = Failover(settings.core, spawn_core)
        client.failover.start_spare()
        client.failover.watch(client, settings.respawn_heartbeat_timeout)
    log.info("Engine ready (pid %d, engine core pid %d): POST http://%s:%d/v1/completions", os.getpid(), ready.pid,
             settings.http.host, settings.http.port)
    run_until_signal(server, on_stop=client.close)
    if died.is_set():
        return client.exit_code()
    log.info("Engine stopped")
    return 0
